// Slurm: host lists and per-node counts as Slurm writes them (the expected expansions are what
// Slurm 22.05's `scontrol show hostnames` prints), the configuration source accel-launch reads
// inside an allocation, its precedence and its errors, and the batch script --slurm-submit writes.
#include "contract/slurm.h"

#include <gtest/gtest.h>

#include <fstream>

#include "agent/config/config_loader.h"
#include "launcher/launch_cli.h"
#include "launcher/slurm_submit.h"

namespace accel {
namespace {

using contract::expand_hostlist;
using contract::expand_per_node_counts;
using Names = std::vector<std::string>;

TEST(SlurmHostlist, ExpandsAsSlurmDoes) {
  EXPECT_EQ(expand_hostlist("gpu[01-04,07],login1").items,
            (Names{"gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "login1"}));
  EXPECT_EQ(expand_hostlist("n[001-003]-ib").items, (Names{"n001-ib", "n002-ib", "n003-ib"}));
  EXPECT_EQ(expand_hostlist("a[1-2]b[3-4]").items, (Names{"a1b3", "a1b4", "a2b3", "a2b4"}));
  EXPECT_EQ(expand_hostlist("n[1-2,4-5]-x[1-2]").items,
            (Names{"n1-x1", "n1-x2", "n2-x1", "n2-x2", "n4-x1", "n4-x2", "n5-x1", "n5-x2"}));
  EXPECT_EQ(expand_hostlist("x[8-11]").items, (Names{"x8", "x9", "x10", "x11"}));
  EXPECT_EQ(expand_hostlist("n[09-11]").items, (Names{"n09", "n10", "n11"}));
  EXPECT_EQ(expand_hostlist("n[0099-101]").items, (Names{"n0099", "n0100", "n0101"}));
  EXPECT_EQ(expand_hostlist("n[7-009]").items, (Names{"n7", "n8", "n9"}));
  EXPECT_EQ(expand_hostlist("n[1-3,2]").items, (Names{"n1", "n2", "n3", "n2"}));
  EXPECT_EQ(expand_hostlist("n[1-2][3]").items, (Names{"n13", "n23"}));
  EXPECT_EQ(expand_hostlist("a,,b").items, (Names{"a", "b"}));
  EXPECT_EQ(expand_hostlist("node17").items, (Names{"node17"}));
  EXPECT_EQ(expand_hostlist("[1-2]").items, (Names{"1", "2"}));
}

TEST(SlurmHostlist, RefusesWhatIsNotAHostList) {
  struct Case {
    const char* text;
    const char* error;
  };
  for (const Case& c : {
           Case{"n[]", "empty brackets [] in 'n[]'"},
           Case{"n[010-9]", "range '010-9' ends below its start in 'n[010-9]'"},
           Case{"n[0-2:2]", "'0-2:2' is not a number or a range such as 1-4 in 'n[0-2:2]'"},
           Case{"n[a-b]", "'a-b' is not a number or a range such as 1-4 in 'n[a-b]'"},
           Case{"n[1-]", "'1-' is not a number or a range such as 1-4 in 'n[1-]'"},
           Case{"n[1-2", "'[' without ']' in 'n[1-2'"},
           Case{"n[1-2]x]", "']' without '[' in 'n[1-2]x]'"},
           Case{"n[1-[2-3]]", "brackets inside brackets in 'n[1-[2-3]]'"},
           Case{"a b", "a space or control character in 'a b'"},
           Case{"", "no host names"},
           Case{",", "no host names"},
           Case{"n[0-99999999]", "expands to more than 65536 names in 'n[0-99999999]'"},
           Case{"a[0-999]b[0-999]", "'a[0-999]b[0-999]' expands to more than 65536 names"},
       }) {
    auto r = expand_hostlist(c.text);
    EXPECT_EQ(r.error, c.error) << c.text;
    EXPECT_TRUE(r.items.empty()) << c.text;
  }
  EXPECT_FALSE(expand_hostlist(std::string(300, 'a')).ok());  // longer than a host name
  // 100 KB of name before 65,536 numbers: refused by its length before any name is built (it
  // used to build 1.5 GB of names and abort on bad_alloc); the message quotes 80 characters.
  auto huge = expand_hostlist(std::string(100000, 'a') + "[1-65536]");
  EXPECT_EQ(huge.error,
            "a host name longer than 255 characters in '" + std::string(80, 'a') + "...'");
  EXPECT_TRUE(huge.items.empty());
  auto widths = expand_hostlist(std::string(251, 'a') + "[99990-99999]");
  EXPECT_EQ(widths.error.rfind("a host name longer than 255 characters in '", 0), 0u)
      << widths.error;  // 251 + 5 digits is one too many
  auto fits = expand_hostlist(std::string(250, 'a') + "[99990-99999]");
  EXPECT_TRUE(fits.ok()) << fits.error;
  EXPECT_EQ(fits.items.size(), 10u);
}

TEST(SlurmHostlist, PerNodeCounts) {
  EXPECT_EQ(expand_per_node_counts("2(x3),1").items, (Names{"2", "2", "2", "1"}));
  EXPECT_EQ(expand_per_node_counts("4").items, (Names{"4"}));
  EXPECT_EQ(expand_per_node_counts("3,1").items, (Names{"3", "1"}));
  for (const char* bad : {"", "2(x)", "2(x0)", "x", "2(3)", "2(x3", "-1", "2(x99999999)"}) {
    EXPECT_FALSE(expand_per_node_counts(bad).ok()) << bad;
  }
}

TEST(SlurmHostlist, PortsFollowTheJobId) {
  EXPECT_EQ(contract::slurm_port_for_job("1", 12000), 12001);
  EXPECT_EQ(contract::slurm_port_for_job("8001", 12000), 12001);
  EXPECT_EQ(contract::slurm_port_for_job("123_4", 20000), 20123);
  EXPECT_EQ(contract::slurm_port_for_job("", 20000), 20000);
}

namespace cfgns = config;

cfgns::EnvMap step_env() {
  return {{"SLURM_JOB_ID", "4242"},
          {"SLURM_STEP_ID", "0"},
          {"SLURM_STEP_NUM_NODES", "2"},
          {"SLURM_STEP_NUM_TASKS", "2"},
          {"SLURM_STEP_NODELIST", "gpu[07-08]"},
          {"SLURM_NODEID", "1"},
          {"SLURM_NNODES", "2"},
          {"SLURM_JOB_NODELIST", "gpu[07-08]"},
          {"SLURM_CPUS_ON_NODE", "16"}};
}

Result<std::string> fake_resolve(const std::string& host) {
  if (host == "gpu07") return std::string("10.0.0.7");
  return Status::error("cannot resolve " + host + ": Name or service not known");
}

Result<cfgns::ResolvedConfig> resolve(cfgns::EnvMap env,
                                      cfgns::SlurmUse use = cfgns::SlurmUse::kAuto,
                                      std::vector<cfgns::FlagValue> flags = {}) {
  env["HOME"] = "/nonexistent-home";
  cfgns::ConfigSources s;
  s.env = std::move(env);
  s.flags = std::move(flags);
  s.slurm = use;
  s.resolve_host = fake_resolve;
  return cfgns::resolve_config(s);
}

TEST(SlurmSource, AStepWithOneTaskPerNodeFillsTheJob) {
  auto r = resolve(step_env(), cfgns::SlurmUse::kAuto, {{"num_processes", "4", "-n"}});
  ASSERT_TRUE(r) << r.message();
  const auto& c = r->config;
  EXPECT_TRUE(r->slurm);
  EXPECT_EQ(c.nodes.min, 2);
  EXPECT_EQ(c.nodes.max, 2);
  EXPECT_EQ(c.machine_rank, 1);
  EXPECT_EQ(c.main_process_ip, "10.0.0.7");
  EXPECT_EQ(c.job_id, "slurm-4242");
  EXPECT_EQ(c.coordinator_port, 20000 + 4242);
  EXPECT_EQ(c.num_cpu_threads_per_process, 4);  // 16 CPUs / 4 processes
  EXPECT_EQ(c.origin("machine_rank").where, "Slurm SLURM_NODEID=1");
  EXPECT_EQ(c.origin("main_process_ip").where, "Slurm SLURM_STEP_NODELIST (first node gpu07)");
  EXPECT_EQ(c.origin("num_cpu_threads_per_process").where,
            "Slurm SLURM_CPUS_ON_NODE=16 / 4 process(es)");
  std::string text = cfgns::render_config(*r);
  EXPECT_NE(text.find("flag > ACCEL_* environment > Slurm > config file"), std::string::npos);
  EXPECT_NE(text.find("nodes: 2"), std::string::npos) << text;
  EXPECT_NE(text.find("# Slurm SLURM_STEP_NUM_NODES=2"), std::string::npos) << text;
}

TEST(SlurmSource, FlagsAndAccelVariablesBeatSlurmWhichBeatsTheFile) {
  auto env = step_env();
  env["ACCEL_MACHINE_RANK"] = "0";
  env["SLURM_GPUS_ON_NODE"] = "8";
  auto r = resolve(env, cfgns::SlurmUse::kAuto, {{"job_id", "mine", "--job-id"}});
  ASSERT_TRUE(r) << r.message();
  EXPECT_EQ(r->config.machine_rank, 0);
  EXPECT_EQ(r->config.job_id, "mine");
  EXPECT_EQ(r->config.num_processes, 8);
  EXPECT_EQ(r->config.origin("num_processes").where, "Slurm SLURM_GPUS_ON_NODE=8");
  EXPECT_EQ(r->config.num_cpu_threads_per_process, 2);

  std::string file = ::testing::TempDir() + "/slurm_test_cluster.yaml";
  {
    std::ofstream out(file);
    out << "nodes: 4\nmain_process_ip: 10.9.9.9\nmax_restarts: 3\n";
  }
  cfgns::ConfigSources s;
  s.config_file = file;
  s.env = step_env();
  s.slurm = cfgns::SlurmUse::kAuto;
  s.resolve_host = fake_resolve;
  auto f = cfgns::resolve_config(s);
  ASSERT_TRUE(f) << f.message();
  EXPECT_EQ(f->config.nodes.max, 2);
  EXPECT_EQ(f->config.main_process_ip, "10.0.0.7");
  EXPECT_EQ(f->config.max_restarts, 3);  // the file's, where Slurm says nothing
}

TEST(SlurmSource, OffOrOutsideAnAllocationReadsNothing) {
  auto r = resolve(step_env(), cfgns::SlurmUse::kOff);
  ASSERT_TRUE(r) << r.message();
  EXPECT_FALSE(r->slurm);
  EXPECT_EQ(r->config.nodes.max, 1);
  EXPECT_EQ(r->config.job_id, "");

  auto none = resolve({}, cfgns::SlurmUse::kAuto);
  ASSERT_TRUE(none);
  EXPECT_FALSE(none->slurm);
  auto forced = resolve({}, cfgns::SlurmUse::kOn);
  ASSERT_FALSE(forced);
  EXPECT_EQ(forced.message(),
            "--slurm: not inside a Slurm allocation (SLURM_JOB_ID is not set); run accel-launch "
            "under sbatch/srun, or drop --slurm");
}

TEST(SlurmSource, SaysHowToStartItRight) {
  // The batch script of a 2-node allocation, not a step: only this node would take part.
  auto batch = step_env();
  for (const char* v :
       {"SLURM_STEP_ID", "SLURM_STEP_NUM_NODES", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST"}) {
    batch.erase(v);
  }
  auto r = resolve(batch);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.message(),
            "Slurm: accel-launch is running in the batch script of job 4242 on 2 nodes "
            "(SLURM_NNODES=2), not in a job step, so only this node would take part. Start one "
            "accel-launch per node: srun --ntasks=2 --ntasks-per-node=1 accel-launch ...; or "
            "pass --no-slurm to run on this node alone");
  EXPECT_TRUE(resolve(batch, cfgns::SlurmUse::kOff));

  struct Case {
    const char* variable;
    const char* value;
    const char* error;
  };
  for (const Case& c : {
           Case{"SLURM_STEP_NUM_TASKS", "4",
                "Slurm: srun started 4 tasks on 2 node(s) (SLURM_STEP_NUM_TASKS=4, "
                "SLURM_STEP_NUM_NODES=2); accel-launch starts the workers itself and wants one "
                "task per node: srun --ntasks=2 --ntasks-per-node=1 accel-launch ... (or let srun "
                "start every rank without accel-launch: srun -n N ./train)"},
           Case{"SLURM_STEP_NODELIST", "gpu[08-09]",
                "Slurm: the job's first node gpu08 (from SLURM_STEP_NODELIST) hosts the "
                "rendezvous, but cannot resolve gpu08: Name or service not known"},
           Case{"SLURM_STEP_NODELIST", "gpu[07-08",
                "Slurm: SLURM_STEP_NODELIST=\"gpu[07-08\": not a host list: '[' without ']' in "
                "'gpu[07-08'"},
           Case{"SLURM_STEP_NODELIST", "gpu07",
                "Slurm: SLURM_STEP_NODELIST=\"gpu07\" names 1 node(s) but SLURM_STEP_NUM_NODES=2"},
           Case{"SLURM_NODEID", "two", "Slurm: SLURM_NODEID=\"two\": expected an integer >= 0"},
           Case{"SLURM_NODEID", "2", "Slurm: SLURM_NODEID=2 but SLURM_STEP_NUM_NODES=2"},
       }) {
    auto env = step_env();
    env[c.variable] = c.value;
    auto bad = resolve(env);
    ASSERT_FALSE(bad) << c.variable << "=" << c.value;
    EXPECT_EQ(bad.message(), c.error);
  }
}

TEST(SlurmSource, ALoneNodeBatchScriptIsFine) {
  cfgns::EnvMap env{{"SLURM_JOB_ID", "7"}, {"SLURM_NNODES", "1"}, {"SLURM_CPUS_ON_NODE", "4"}};
  auto r = resolve(env, cfgns::SlurmUse::kAuto, {{"num_processes", "2", "-n"}});
  ASSERT_TRUE(r) << r.message();
  EXPECT_EQ(r->config.nodes.max, 1);
  EXPECT_EQ(r->config.job_id, "slurm-7");
  EXPECT_EQ(r->config.num_cpu_threads_per_process, 2);
}

TEST(SlurmSubmit, TheScriptRunsThisLaunchOnEveryNode) {
  auto parsed = launcher::parse_launch_command({"--slurm-submit", "--nodes", "2", "-n", "2",
                                                "--sbatch-arg=--time=1:00:00", "--max-restarts",
                                                "3", "./train", "--lr", "3e-4 x"});
  ASSERT_TRUE(parsed.command) << parsed.text;
  const auto& cmd = *parsed.command;
  EXPECT_TRUE(cmd.slurm_submit);
  EXPECT_EQ(cmd.resubmit, (std::vector<std::string>{"-n", "2", "--max-restarts", "3"}));
  cfgns::ClusterConfig cfg;
  cfg.nodes = {2, 2};
  cfg.num_processes = 2;
  launcher::SubmitScript where{"/opt/accel/bin/accel-launch", "/home/me/run 1", "train"};
  std::string script =
      launcher::sbatch_script(cmd, cfg, {"/home/me/train", "--lr", "3e-4 x"}, where);
  for (const char* line :
       {"#SBATCH --nodes=2\n", "#SBATCH --ntasks-per-node=1\n", "#SBATCH --signal=USR1@60\n",
        "#SBATCH --requeue\n", "#SBATCH --time=1:00:00\n", "cd '/home/me/run 1' || exit 1\n",
        "srun --ntasks-per-node=1 --ntasks=\"$SLURM_NNODES\" --kill-on-bad-exit=1 "
        "/opt/accel/bin/accel-launch -n 2 --max-restarts 3 -- /home/me/train --lr '3e-4 x' &\n",
        "trap 'kill -USR1 \"$srun_pid\" 2>/dev/null' USR1\n", "if [ \"$rc\" -eq 138 ]; then\n"}) {
    EXPECT_NE(script.find(line), std::string::npos) << line << "\n---\n" << script;
  }
  EXPECT_EQ(launcher::shell_quote("it's"), "'it'\\''s'");
  EXPECT_EQ(launcher::shell_quote(""), "''");
}

TEST(SlurmSubmit, SlurmFlagsParse) {
  auto on = launcher::parse_launch_command({"--slurm", "./train"});
  ASSERT_TRUE(on.command);
  EXPECT_EQ(on.command->slurm, cfgns::SlurmUse::kOn);
  auto off = launcher::parse_launch_command({"--no-slurm", "./train"});
  ASSERT_TRUE(off.command);
  EXPECT_EQ(off.command->slurm, cfgns::SlurmUse::kOff);
  auto both = launcher::parse_launch_command({"--slurm", "--no-slurm", "./train"});
  EXPECT_FALSE(both.command);
  EXPECT_EQ(both.exit_code, 2);
}

}  // namespace
}  // namespace accel
