#!/usr/bin/env python3
"""Turns every C++ block of README.md and docs/*.md into one translation unit that CMake builds
(target docs_cpp_blocks; ctest docs.EveryCppBlockCompiles), so the docs' C++ cannot drift from
the headers.

Every fenced block whose info string is cpp or c++ carries a marker on the line before its fence:

  <!-- doc: cpp program [name=NAME] -->       a whole program (its own includes and main)
  <!-- doc: cpp fragment [CONTEXT] -->        statements: compiled as the body of a member
                                              function of a struct deriving from
                                              doc::context::CONTEXT (tests/docs/cpp_context.h;
                                              default loop), whose members are the names the
                                              page assumes (acc, model, m, dl, batch, ...)
  <!-- doc: cpp declarations [CONTEXT] -->    namespace-scope declarations

In every block, #include lines are hoisted to the top of the unit, and a line that is only "..."
stands for code left out. Each block lives in a namespace of its own, and #line directives make
a compiler error name the page and line. A program named with name=NAME can be run:
`docs_cpp_blocks NAME args...` calls its main.

The porting table of docs/runtime.md ("## From HF Accelerate") is checked too: a row whose
libaccel column says "the same names" has each HF name of its first column declared as a member
of accel::Accelerator (a using-declaration: it fails if there is no such public member), and
every other C++ code span of the libaccel column is compiled as a statement, a type
(`accel::Batch`) or a member (`AcceleratorOptions::log_with`) in the loop context.

Usage: cpp_blocks.py --out FILE.cpp       (writes FILE only when its text changes)
       cpp_blocks.py --list               (the blocks and their kinds)
"""

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_docs  # noqa: E402  (the same page parser and markers)

ROOT = run_docs.ROOT
CPP_INFOS = {"cpp", "c++"}
CPP_KINDS = {"program", "fragment", "declarations"}
INCLUDE_RE = re.compile(r"^\s*#\s*include\s*[<\"].*[>\"]\s*$")
PORTING_HEADING = "## From HF Accelerate"
PORTING_PAGE = "docs/runtime.md"


class Problem(Exception):
    pass


def pages():
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def cpp_blocks(page, problems):
    _, blocks, errors = run_docs.parse_page(page)
    problems.extend(errors)
    out = []
    for b in blocks:
        if b.info.lower() not in CPP_INFOS:
            if b.kind == "cpp":
                problems.append(f"{b.where()}: a 'doc: cpp' marker on a ```{b.info} block")
            continue
        if b.kind != "cpp":
            problems.append(f"{b.where()}: ```{b.info} block without a 'doc: cpp program|fragment|"
                            "declarations' marker on the line before it")
            continue
        words = b.opts.get("words", [])
        if not words or words[0] not in CPP_KINDS:
            problems.append(f"{b.where()}: 'doc: cpp' takes one of {', '.join(sorted(CPP_KINDS))}")
            continue
        kind, rest = words[0], words[1:]
        name, context = None, "loop"
        for w in rest:
            if w.startswith("name=") and kind == "program":
                name = w[len("name="):]
            elif kind != "program" and re.fullmatch(r"[a-z_]+", w):
                context = w
            else:
                problems.append(f"{b.where()}: unknown option '{w}' for 'doc: cpp {kind}'")
        out.append((b, kind, context, name))
    return out


def ident(b):
    rel = str(b.page.relative_to(ROOT))
    return re.sub(r"\W", "_", rel) + f"_{b.line}"


def body_lines(b, includes):
    """The block's lines with includes hoisted and '...' lines made comments, each preceded by
    the #line that maps it to the page."""
    rel = str(b.page.relative_to(ROOT))
    out = []
    for n, text in enumerate(b.lines):
        page_line = b.line + 1 + n
        if INCLUDE_RE.match(text):
            includes.setdefault(text.strip(), f"{rel}:{page_line}")
            text = ""
        elif text.strip() == "...":
            text = text.replace("...", "// ...")
        out.append(f'#line {page_line} "{rel}"')
        out.append(text)
    return out


def render_block(b, kind, context, name, includes, programs):
    ns = "doc_" + ident(b)
    lines = [f"namespace {ns} {{", "using namespace doc::types;"]
    if kind == "program":
        lines += body_lines(b, includes)
        lines.append("}  // namespace " + ns)
        programs.append((name or f"{b.page.relative_to(ROOT)}:{b.line}", ns))
    elif kind == "declarations":
        lines += body_lines(b, includes)
        lines.append("}  // namespace " + ns)
    else:
        lines.append(f"struct Block : doc::context::{context} {{")
        lines.append("  void run() {")
        lines += body_lines(b, includes)
        lines.append("  }")
        lines.append("};")
        lines.append("}  // namespace " + ns)
    return lines


CODE_SPAN_RE = re.compile(r"`([^`]+)`")
HF_NAME_RE = re.compile(r"^(?:accelerator\.)?([A-Za-z_]\w*)")


def porting_rows(problems):
    page = ROOT / PORTING_PAGE
    lines = page.read_text().split("\n")
    try:
        start = lines.index(PORTING_HEADING)
    except ValueError:
        problems.append(f"{PORTING_PAGE}: no '{PORTING_HEADING}' section (the porting table)")
        return []
    rows = []
    i = start + 1
    while i < len(lines) and not lines[i].startswith("|"):
        i += 1
    i += 2  # header and separator
    while i < len(lines) and lines[i].startswith("|"):
        cells = [c.strip() for c in lines[i].strip().strip("|").split(" | ")]
        if len(cells) != 2:
            problems.append(f"{PORTING_PAGE}:{i + 1}: a porting-table row needs 2 cells, has {len(cells)}")
        else:
            rows.append((i + 1, cells[0], cells[1]))
        i += 1
    if not rows:
        problems.append(f"{PORTING_PAGE}:{start + 1}: the porting table has no rows")
    return rows


def span_as_code(span):
    """C++ that uses the code span, or None when the span is not C++ (a shell command, prose)."""
    s = span.strip()
    if re.match(r"^(accel-launch|accelerate|python|torchrun)\b", s) or s.startswith("std::"):
        return None
    m = re.fullmatch(r"(?:accel::)?([A-Z]\w*)::([a-z_]\w*)", s)
    if m:
        return f"(void)&accel::{m.group(1)}::{m.group(2)};"
    m = re.fullmatch(r"(?:accel::)?([A-Z]\w*)", s)
    if m:
        return f"(void)sizeof(accel::{m.group(1)}*);"
    if re.match(r"^(acc\.|accel::|auto |m\(|m->|o\.|dl\.|s\.|batch\[|logger\.)", s):
        s = s.replace("{ ... }", "{}").rstrip(";")
        # Why (void): a span shows a call alone, whose result ([[nodiscard]]) it drops.
        declaration = re.match(r"^(auto|[\w:]+(<[^>]*>)?)\s+\[?\w", s)
        return s + ";" if declaration else f"(void)({s});"
    return None


def render_porting(problems):
    rows = porting_rows(problems)
    names, statements, declared = [], [], set()
    for line, hf, ours in rows:
        if "the same names" in ours:
            found = [HF_NAME_RE.match(sp.strip()) for sp in CODE_SPAN_RE.findall(hf)]
            if not any(found):
                problems.append(f"{PORTING_PAGE}:{line}: 'the same names', but the HF column names none")
            for m in found:
                if m and m.group(1) not in declared:
                    declared.add(m.group(1))
                    names += [f'#line {line} "{PORTING_PAGE}"', f"  using accel::Accelerator::{m.group(1)};"]
        for sp in CODE_SPAN_RE.findall(ours):
            code = span_as_code(sp)
            if code is not None:
                statements += [f'#line {line} "{PORTING_PAGE}"', "    " + code]
    return (["namespace doc_porting_table {",
             "using namespace doc::types;", "struct SameNames : accel::Accelerator {"] + names +
            ["};", "struct Spans : doc::context::loop {", "  void run() {"] + statements +
            ["  }", "};", "}  // namespace doc_porting_table"])


FIELDS_RE = re.compile(r"^<!--\s*fields:\s*([\w:]+)\s*-->$")


def render_field_tables(problems):
    """A table after `<!-- fields: TYPE -->` lists TYPE's fields in declaration order: a
    designated initializer naming them in the table's order must compile."""
    out = []
    for page in pages():
        rel = str(page.relative_to(ROOT))
        lines = page.read_text().split("\n")
        for i, text in enumerate(lines):
            m = FIELDS_RE.match(text.strip())
            if not m:
                continue
            j, inits = i + 3, []
            if j > len(lines) or not lines[i + 1].startswith("|"):
                problems.append(f"{rel}:{i + 1}: a 'fields:' comment not directly before a table")
                continue
            while j < len(lines) and lines[j].startswith("|"):
                field = re.match(r"^\|\s*`(\w+)`", lines[j])
                if not field:
                    problems.append(f"{rel}:{j + 1}: a field row must start with the field's name in backticks")
                else:
                    inits += [f'#line {j + 1} "{rel}"', f"      .{field.group(1)} = {{}},"]
                j += 1
            out += [f"[[maybe_unused]] inline void fields_{len(out)}() {{",
                    f"  (void){m.group(1)}{{"] + inits + ["  };", "}"]
    return ["namespace doc_field_tables {"] + out + ["}  // namespace doc_field_tables"]


def generate():
    problems, includes, programs, parts = [], {}, [], []
    count = {k: 0 for k in CPP_KINDS}
    for page in pages():
        for b, kind, context, name in cpp_blocks(page, problems):
            count[kind] += 1
            parts += render_block(b, kind, context, name, includes, programs)
    parts += render_porting(problems)
    parts += render_field_tables(problems)
    names = [n for n, _ in programs]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        problems.append(f"program names used twice: {', '.join(sorted(dup))}")
    head = ["// Generated by tests/docs/cpp_blocks.py from README.md and docs/*.md: do not edit.",
            '#include "tests/docs/cpp_context.h"']
    head += sorted(includes)
    tail = ["", "int main(int argc, char** argv) {", "  static const std::vector<doc::Program> programs = {"]
    tail += [f'      {{"{n}", [](int c, char** v) {{ return doc::call(&{ns}::main, c, v); }}}},' for n, ns in programs]
    tail += ["  };", "  return doc::dispatch(programs, argc, argv);", "}"]
    return "\n".join(head + [""] + parts + tail) + "\n", problems, count


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args()
    text, problems, count = generate()
    if args.list:
        for page in pages():
            for b, kind, context, name in cpp_blocks(page, []):
                print(f"{b.where()}: {kind} {name or context}")
    if problems:
        for p in problems:
            print(f"cpp_blocks: {p}", file=sys.stderr)
        return 1
    if args.out:
        if not args.out.exists() or args.out.read_text() != text:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text)
        print(f"cpp_blocks: {count['program']} programs, {count['fragment']} fragments, "
              f"{count['declarations']} declaration blocks and the porting table -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
