#!/usr/bin/env python3
"""Runs the shell blocks of README.md and docs/*.md and compares their output with the page.

Every fenced block whose info string is empty, sh, bash, console, shell or text carries a
marker, an HTML comment on the line directly before its opening fence:

  <!-- doc: run [exit=N] [timeout=S] [background] -->   run the block with bash -c
  <!-- doc: output -->                                  the expected output of the run block before it
  <!-- doc: transcript [exit=N|N,N,...] [timeout=S] --> "$ command" lines, each followed by its output
  <!-- doc: file NAME -->                               write the block to NAME before later blocks run
  <!-- doc: example -->                                 shown, not run (placeholders, root, Slurm, GPUs, slow)

C++ blocks carry `<!-- doc: cpp program|fragment|declarations -->` instead: tests/docs/cpp_blocks.py
compiles them.

The blocks of one page run in order in one fresh sandbox folder (symlinks to the checkout's
top-level entries, `build` pointing at --build-dir; HOME=<sandbox>/home), with
PATH=<build>/bin:/usr/bin:/bin and LC_ALL=C. Output (stdout and stderr merged) is compared
after masking what varies (job ids, ports, pids, times, durations, temporary names, hashes),
line group by line group ([rank N], [accel-launch], the rest), since ranks interleave; a line
`...` matches any number of unprefixed lines, `[rank 1] ...` any number of rank 1's lines (a
block of `...` alone matches anything). --update rewrites the outputs that no longer match
(those with `...` are kept as written, and still checked); --update cannot fix an exit code.

Usage: run_docs.py --build-dir BUILD [--update] [--page docs/launch.md ...] [-v]
"""

import argparse
import difflib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECKED_INFOS = {"", "sh", "bash", "console", "shell", "text"}
KINDS = {"run", "output", "transcript", "file", "example", "cpp"}
MARKER_RE = re.compile(r"^\s*<!--\s*doc:\s*(.*?)\s*-->\s*$")
FENCE_RE = re.compile(r"^( *)(`{3,}|~{3,})(.*)$")
GROUP_RE = re.compile(r"^\[(rank \d+|accel-launch|[A-Za-z0-9._-]+:\d+)\](?: |$)")
WILDCARD = "..."

# Readers see the sandbox as the checkout they run the commands in, their home as /home/me.
HOME_SHOWN = "/home/me"

MASKS = [
    # mkdtemp-style suffixes: /tmp/accel-test-B8A8ao/... -> /tmp/accel-test-XXXXXX/... (and the
    # snapshot folders' /dev/shm/accel-snapshots-5rgvoY/...)
    (re.compile(r"(/(?:tmp|dev/shm)/[\w.-]+-)[A-Za-z0-9]{6}(?=[/\s'\"]|$)"), r"\1XXXXXX"),
    (re.compile(r"\b\d{8}-\d{6}-[0-9a-f]{4}\b"), "<JOB>"),
    (re.compile(r"\b(MASTER_PORT|main_process_port)=\d+"), r"\1=<PORT>"),
    (re.compile(r"(?<=[\w\]]):\d{4,5}\b"), ":<PORT>"),
    (re.compile(r"\bport \d+\b"), "port <PORT>"),
    (re.compile(r"\bpids? \d+\b"), "pid <PID>"),
    (re.compile(r"\b\d\d:\d\d:\d\d(?:\.\d+)?\b"), "<TIME>"),
    (re.compile(r"\b\d+\.\d+ ?(?:ms|s|m|min|h)\b"), "<DUR>"),
    (re.compile(r"\b\d+ ?ms\b"), "<DUR>"),
    (re.compile(r"\b\d+ s\b"), "<DUR>"),
    (re.compile(r'("\w+_s"): \d+(?:\.\d+)?'), r"\1: <DUR>"),  # JSON seconds: "save_s": 0.0074
    (re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{12,}\b"), "<HEX>"),
]


class DocError(Exception):
    pass


class Block:
    def __init__(self, page, line, indent, info, lines, start, end):
        self.page = page          # Path
        self.line = line          # 1-based line number of the opening fence
        self.indent = indent      # the fence's indentation, removed from every content line
        self.info = info          # first word of the info string
        self.lines = lines        # content lines, indentation removed
        self.start = start        # index (0-based) of the first content line in the page
        self.end = end            # index of the closing fence
        self.kind = None
        self.opts = {}
        self.output = None        # the output block that follows a run block
        self.new_lines = None     # replacement content for --update

    def where(self):
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def parse_marker(text, where):
    words = text.split()
    if not words or words[0] not in KINDS:
        raise DocError(f"{where}: unknown doc marker '{text}' (one of: {', '.join(sorted(KINDS))})")
    kind, opts = words[0], {}
    rest = words[1:]
    if kind == "cpp":  # C++ blocks: compiled by tests/docs/cpp_blocks.py, not run here
        return kind, {"words": rest}
    if kind == "file":
        if len(rest) != 1:
            raise DocError(f"{where}: '<!-- doc: file NAME -->' takes one file name")
        return kind, {"name": rest[0]}
    for w in rest:
        key, _, value = w.partition("=")
        if kind in ("run", "transcript") and key in ("exit", "timeout") and value:
            opts[key] = value
        elif kind == "run" and w == "background":
            opts["background"] = True
        else:
            raise DocError(f"{where}: unknown option '{w}' for doc marker '{kind}'")
    return kind, opts


def parse_page(page):
    """Returns the page's text lines and its fenced blocks with their markers."""
    text = page.read_text()
    lines = text.split("\n")
    blocks, errors = [], []
    i = 0
    while i < len(lines):
        m = FENCE_RE.match(lines[i])  # any indentation: a fence inside a list item is indented
        if not m:
            i += 1
            continue
        indent, fence, info = m.group(1), m.group(2), m.group(3).strip()
        if fence[0] == "`" and "`" in info:
            i += 1
            continue
        j = i + 1
        close = re.compile(r"^ *" + re.escape(fence[0]) + "{" + str(len(fence)) + r",}\s*$")
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        if j >= len(lines):
            errors.append(f"{page.relative_to(ROOT)}:{i + 1}: code fence never closed")
            break
        content = []
        for raw in lines[i + 1:j]:
            k = 0
            while k < len(indent) and k < len(raw) and raw[k] == " ":
                k += 1
            content.append(raw[k:])
        b = Block(page, i + 1, indent, info.split()[0] if info else "", content, i + 1, j)
        if i > 0:
            mm = MARKER_RE.match(lines[i - 1])
            if mm:
                try:
                    b.kind, b.opts = parse_marker(mm.group(1), b.where())
                except DocError as e:
                    errors.append(str(e))
        blocks.append(b)
        i = j + 1
    # A marker must sit directly before a fence.
    fence_lines = {b.line - 1 for b in blocks}
    for n, l in enumerate(lines):
        if MARKER_RE.match(l) and n + 1 not in fence_lines:
            errors.append(f"{page.relative_to(ROOT)}:{n + 1}: doc marker not directly before a code fence")
    prev = None
    for b in blocks:
        if b.kind is None and b.info in CHECKED_INFOS:
            errors.append(f"{b.where()}: ```{b.info} block without a doc marker "
                          "(<!-- doc: run|output|transcript|file NAME|example --> on the line before it)")
        if b.kind == "output":
            if prev is None or prev.kind != "run":
                kind = prev.kind if prev is not None and prev.kind else "no marked block"
                errors.append(f"{b.where()}: output block must follow a run block (it follows {kind}"
                              + ("; mark the output of an example block 'example' too" if kind == "example" else "")
                              + ")")
            elif prev.output is not None:
                errors.append(f"{b.where()}: a second output block for the run block at {prev.where()}")
            else:
                prev.output = b
        if b.kind in ("run", "transcript"):
            for key in ("exit", "timeout"):
                if key in b.opts:
                    vals = b.opts[key].split(",")
                    if not all(re.fullmatch(r"\d+", v) for v in vals) or (
                            len(vals) > 1 and (key == "timeout" or b.kind == "run")):
                        errors.append(f"{b.where()}: bad {key}={b.opts[key]}")
        prev = b
    return lines, blocks, errors


# ---------------------------------------------------------------------------------------------
# Running


def kill_group(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_shell(cmd, cwd, env, timeout, background=False):
    """Runs cmd with bash -c in its own process group. Returns (rc or None on timeout, output)."""
    if background:  # left running for the page's later blocks; its output is not checked
        proc = subprocess.Popen(["bash", "-c", cmd], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        return proc, ""
    proc = subprocess.Popen(["bash", "-c", cmd], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    chunks = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: proc.stdout.read1(65536), b"")),
                              daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        proc.wait()
        rc = None
    # Whatever the block left running in its process group goes with it.
    kill_group(proc.pid)
    reader.join(5)
    out = b"".join(chunks).decode("utf-8", errors="replace")
    return rc, out


class Sandbox:
    def __init__(self, build_dir):
        self.build_dir = build_dir
        self.path = Path(tempfile.mkdtemp(prefix="accel-docs-")).resolve()
        for entry in ROOT.iterdir():
            if entry.name.startswith(".") or entry.name == "build":
                continue
            (self.path / entry.name).symlink_to(entry)
        (self.path / "build").symlink_to(build_dir)
        (self.path / "home").mkdir()
        self.env = {
            "HOME": str(self.path / "home"),
            "PATH": f"{build_dir}/bin:/usr/bin:/bin",
            "LC_ALL": "C",
            "USER": os.environ.get("USER", "me"),
            "LOGNAME": os.environ.get("LOGNAME", os.environ.get("USER", "me")),
            "SHELL": "/bin/bash",
        }
        self.background = []
        home = str(self.path / "home")
        root = str(ROOT)
        reps = [(home, HOME_SHOWN)]
        for b in {str(build_dir), os.path.realpath(build_dir)}:
            reps.append((b, "./build"))
        # The sandbox is the checkout the reader works in: ./x inside it, ~/accel for itself.
        reps += [(root + "/", "./"), (str(self.path) + "/", "./"), (str(self.path), "~/accel")]
        self.replacements = reps
        host = socket.gethostname().split(".")[0]
        self.host_re = re.compile(r"\b" + re.escape(host) + r"\b") if host != "vm" and len(host) >= 3 else None

    def localize(self, text):
        """Actual output as the docs show it: paths in the sandbox ./x (the sandbox itself
        ~/accel), its HOME /home/me, the build ./build, the host vm."""
        for a, b in self.replacements:
            text = text.replace(a, b)
        if self.host_re:
            text = self.host_re.sub("vm", text)
        return text

    def close(self):
        for proc in self.background:
            kill_group(proc.pid)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        shutil.rmtree(self.path, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Comparing


def clean_lines(text_lines):
    out = [l.rstrip() for l in text_lines]
    while out and out[-1] == "":
        out.pop()
    while out and out[0] == "":
        out.pop(0)
    return out


def mask(line):
    for rx, rep in MASKS:
        line = rx.sub(rep, line)
    return line


def group_of(line):
    m = GROUP_RE.match(line)
    return m.group(1) if m else ""


def split_groups(lines, expected):
    """{group: [masked lines]} in order of first appearance. In an expected block a line `...`
    (the unprefixed group) or `[rank 1] ...` (that group) is kept as WILDCARD."""
    groups = {}
    for l in lines:
        g = group_of(l)
        body = l[len(g) + 3:] if g else l
        if expected and body.strip() == WILDCARD:
            groups.setdefault(g, []).append(WILDCARD)
        else:
            groups.setdefault(g, []).append(mask(l))
    return groups


def match_lines(exp, act):
    memo = {}

    def m(i, j):
        key = (i, j)
        if key in memo:
            return memo[key]
        if i == len(exp):
            r = j == len(act)
        elif exp[i] == WILDCARD:
            r = m(i + 1, j) or (j < len(act) and m(i, j + 1))
        else:
            r = j < len(act) and exp[i] == act[j] and m(i + 1, j + 1)
        memo[key] = r
        return r

    sys.setrecursionlimit(max(10000, 4 * (len(exp) + len(act)) + 100))
    return m(0, 0)


def expand_wildcards(exp, act):
    """exp with each `...` replaced by the actual lines it best stands for (an alignment of
    least edits), so that a diff shows only the lines that really differ."""
    n, m = len(exp), len(act)
    big = n + m + 1
    dp = [[big] * (m + 1) for _ in range(n + 1)]
    dp[0][0] = 0
    for i in range(n + 1):
        for j in range(m + 1):
            if i == 0 and j == 0:
                continue
            best = big
            if i > 0 and exp[i - 1] == WILDCARD:
                best = dp[i - 1][j]
                if j > 0:
                    best = min(best, dp[i][j - 1])
            elif i > 0:
                best = dp[i - 1][j] + 1
                if j > 0:
                    best = min(best, dp[i - 1][j - 1] + (0 if exp[i - 1] == act[j - 1] else 2))
            if j > 0 and (i == 0 or exp[i - 1] != WILDCARD):
                best = min(best, dp[i][j - 1] + 1)
            dp[i][j] = best
    out = []
    i, j = n, m
    while i > 0 or j > 0:
        if i > 0 and exp[i - 1] == WILDCARD:
            if j > 0 and dp[i][j] == dp[i][j - 1]:
                out.append(act[j - 1])
                j -= 1
            else:
                i -= 1
        elif i > 0 and j > 0 and dp[i][j] == dp[i - 1][j - 1] + (0 if exp[i - 1] == act[j - 1] else 2):
            out.append(exp[i - 1])
            i, j = i - 1, j - 1
        elif i > 0 and dp[i][j] == dp[i - 1][j] + 1:
            out.append(exp[i - 1])
            i -= 1
        else:
            j -= 1
    return out[::-1]


def compare(expected, actual):
    """Returns None when they match, else a unified diff of the masked lines of the groups that
    differ (a `...` shown as the lines it stands for)."""
    if expected and all(l.strip() == WILDCARD for l in expected):
        return None  # an output shown as `...` alone: anything
    eg = split_groups(expected, True)
    ag = split_groups(actual, False)
    names = list(eg) + [g for g in ag if g not in eg]
    bad = [g for g in names if not match_lines(eg.get(g, []), ag.get(g, []))]
    if not bad:
        return None
    exp_flat, act_flat = [], []
    for g in bad:
        exp_flat += expand_wildcards(eg.get(g, []), ag.get(g, []))
        act_flat += ag.get(g, [])
    diff = difflib.unified_diff(exp_flat, act_flat, "expected (masked; the groups that differ)",
                                "actual (masked)", lineterm="", n=2)
    return "\n".join(diff)


def updated_lines(expected, actual):
    """The actual lines, where a line equal after masking keeps the page's text (its job id,
    port, pid), so that --update changes only what really changed."""
    sm = difflib.SequenceMatcher(a=[mask(l) for l in expected], b=[mask(l) for l in actual], autojunk=False)
    out = []
    for op, i1, i2, j1, j2 in sm.get_opcodes():
        out += expected[i1:i2] if op == "equal" else actual[j1:j2]
    return out


def has_wildcard(lines):
    return any((l[len(group_of(l)) + 3:] if group_of(l) else l).strip() == WILDCARD for l in lines)


# ---------------------------------------------------------------------------------------------
# Pages


def parse_transcript(block):
    """[(command, [expected lines])]"""
    items = []
    cmd = None
    cont = False
    for l in block.lines:
        if cont:
            cmd[0].append(l)
            cont = l.rstrip().endswith("\\")
            continue
        if l.startswith("$ "):
            cmd = ([l[2:]], [])
            items.append(cmd)
            cont = l.rstrip().endswith("\\")
        elif cmd is None:
            if l.strip():
                raise DocError(f"{block.where()}: a transcript starts with a '$ command' line")
        else:
            cmd[1].append(l)
    return [("\n".join(c), out) for c, out in items]


class Runner:
    def __init__(self, build_dir, update, verbose):
        self.build_dir = build_dir
        self.update = update
        self.verbose = verbose
        self.failures = 0
        self.ran = 0
        self.commands = 0
        self.examples = 0
        self.files = 0
        self.counts = {}

    def fail(self, block, cmd, message, out=None):
        self.failures += 1
        print(f"FAIL {block.where()}: {message}")
        print("  command: " + cmd.replace("\n", "\n           "))
        if out is not None:
            print(out)
        print()

    def judge(self, b, cmd, rc, want, timeout, expected, actual, what):
        """'ok', 'update' (only the output differs, and --update may rewrite it) or 'fail'."""
        shown = "  output:\n" + indent_text("\n".join(actual))
        if rc is None:
            self.fail(b, cmd, f"timed out after {timeout} s (killed)", shown)
            return "fail"
        diff = compare(expected, actual) if expected is not None else None
        if rc != want:
            more = f"; the output differs from {what} too" if diff else ""
            self.fail(b, cmd, f"exit code {rc}, the page says {want}{more}", diff or shown)
            return "fail"
        if diff is None:
            return "ok"
        if self.update and not has_wildcard(expected):
            return "update"
        self.fail(b, cmd, f"output differs from {what}", diff)
        return "fail"

    def run_page(self, page):
        lines, blocks, errors = parse_page(page)
        rel = str(page.relative_to(ROOT))
        counts = self.counts.setdefault(rel, {"run": 0, "transcript": 0, "example": 0, "file": 0, "output": 0})
        for e in errors:
            self.failures += 1
            print(f"FAIL {e}")
        if errors:
            print()
            return
        sandbox = Sandbox(self.build_dir)
        t_page = time.monotonic()
        try:
            for b in blocks:
                if b.kind in counts:
                    counts[b.kind] += 1
                if b.kind == "example":
                    self.examples += 1
                elif b.kind == "file":
                    self.files += 1
                    target = sandbox.path / b.opts["name"]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_text("\n".join(b.lines) + "\n")
                elif b.kind == "run":
                    self.run_block(b, sandbox)
                elif b.kind == "transcript":
                    self.run_transcript(b, sandbox)
        finally:
            sandbox.close()
        if self.verbose:
            print(f"{rel}: {time.monotonic() - t_page:.1f} s")
        if self.update:
            self.rewrite(page, lines, blocks)

    def run_block(self, b, sandbox):
        cmd = "\n".join(b.lines)
        timeout = int(b.opts.get("timeout", 60))
        want = int(b.opts.get("exit", 0))
        t0 = time.monotonic()
        if b.opts.get("background"):
            proc, _ = run_shell(cmd, sandbox.path, sandbox.env, timeout, background=True)
            sandbox.background.append(proc)
            self.ran += 1
            return
        rc, out = run_shell(cmd, sandbox.path, sandbox.env, timeout)
        self.ran += 1
        self.commands += 1
        if self.verbose:
            print(f"  {b.where()} run: exit {rc}, {time.monotonic() - t0:.1f} s")
        actual = clean_lines(sandbox.localize(out).split("\n"))
        expected = clean_lines(b.output.lines) if b.output is not None else None
        what = f"the output block at {b.output.where()}" if b.output is not None else ""
        if self.judge(b, cmd, rc, want, timeout, expected, actual, what) == "update":
            b.output.new_lines = updated_lines(expected, actual)
            print(f"updated {b.output.where()} (output of {b.where()})")

    def run_transcript(self, b, sandbox):
        try:
            items = parse_transcript(b)
        except DocError as e:
            self.failures += 1
            print(f"FAIL {e}")
            return
        timeout = int(b.opts.get("timeout", 60))
        exits = [int(x) for x in b.opts.get("exit", "0").split(",")]
        if len(exits) == 1:
            exits = exits * len(items)
        if len(exits) != len(items):
            self.failures += 1
            print(f"FAIL {b.where()}: exit= lists {len(exits)} codes for {len(items)} commands")
            return
        self.ran += 1
        new, changed = [], False
        for (cmd, exp_lines), want in zip(items, exits):
            t0 = time.monotonic()
            rc, out = run_shell(cmd, sandbox.path, sandbox.env, timeout)
            self.commands += 1
            if self.verbose:
                print(f"  {b.where()} $ {cmd.splitlines()[0][:60]}: exit {rc}, {time.monotonic() - t0:.1f} s")
            actual = clean_lines(sandbox.localize(out).split("\n"))
            new += ["$ " + cmd.split("\n")[0]] + cmd.split("\n")[1:]
            expected = clean_lines(exp_lines)
            if self.judge(b, cmd, rc, want, timeout, expected, actual, "the transcript") == "update":
                new += updated_lines(expected, actual)
                changed = True
            else:
                new += exp_lines
        if changed:
            b.new_lines = new
            print(f"updated {b.where()} (transcript)")

    def rewrite(self, page, lines, blocks):
        edits = [b for b in blocks if b.new_lines is not None]
        if not edits:
            return
        for b in sorted(edits, key=lambda b: b.start, reverse=True):
            body = [(b.indent + l) if l else "" for l in b.new_lines]
            lines[b.start:b.end] = body
        page.write_text("\n".join(lines))


def indent_text(text):
    return "\n".join("    " + l for l in text.split("\n"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build-dir", required=True, help="the build folder (its bin/ has the programs)")
    ap.add_argument("--update", action="store_true", help="rewrite output blocks that no longer match")
    ap.add_argument("--page", action="append", default=[], help="only this page (repeatable), e.g. docs/launch.md")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()

    build_dir = Path(args.build_dir).resolve()
    if not (build_dir / "bin" / "accel-launch").exists():
        print(f"run_docs: {build_dir}/bin/accel-launch does not exist (--build-dir is the build folder)")
        return 2
    pages = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    if args.page:
        # A page names a file from the current folder, or from the checkout's root.
        wanted = [Path(p).resolve() if Path(p).exists() else (ROOT / p).resolve() for p in args.page]
        for w in wanted:
            if w not in pages:
                print(f"run_docs: {w} is not one of the checked pages")
                return 2
        pages = [p for p in pages if p in wanted]

    runner = Runner(build_dir, args.update, args.verbose)
    t0 = time.monotonic()
    for page in pages:
        runner.run_page(page)
    elapsed = time.monotonic() - t0
    for rel, c in runner.counts.items():
        if args.verbose:
            print(f"  {rel}: {c['run']} run, {c['transcript']} transcript, {c['example']} example, "
                  f"{c['file']} file, {c['output']} output")
    print(f"run_docs: {len(pages)} pages, {runner.ran} blocks run ({runner.commands} commands), "
          f"{runner.examples} examples, {runner.files} files, {runner.failures} failures, {elapsed:.1f} s")
    return 1 if runner.failures else 0


if __name__ == "__main__":
    sys.exit(main())
