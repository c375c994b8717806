// Run directories and checkpoints on disk (std::filesystem), and the plan of
// a run: which directory it writes and what it resumes from, agreed across
// ranks.
#include "run_dir.h"

#include "checkpoint.h"

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <unistd.h>

namespace fusetrain::trainer {

namespace fs = std::filesystem;

bool is_dir(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec);
}

bool is_file(const std::string& path) {
  std::error_code ec;
  return fs::is_regular_file(path, ec);
}

void make_dirs(const std::string& path) {
  std::error_code ec;
  fs::create_directories(path, ec);
  if (ec) throw std::runtime_error("cannot create directory " + path + ": " + ec.message());
}

std::vector<std::string> list_dir(const std::string& path) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(path, ec)) {
    out.push_back(entry.path().filename().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string parent_of(const std::string& path) {
  const std::string parent = fs::path(path).parent_path().string();
  return parent.empty() ? "." : parent;
}

std::string base_of(const std::string& path) { return fs::path(path).filename().string(); }

std::string checkpoint_dir(const std::string& run_dir) { return run_dir + "/checkpoints"; }

/// Checkpoints of a run directory, oldest step first.
std::vector<std::pair<int64_t, std::string>> checkpoints_in(const std::string& run_dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  for (const auto& name : list_dir(checkpoint_dir(run_dir))) {
    // Exactly step_<digits>.pt: not a temporary file a killed writer left.
    long long step = 0;
    int used = 0;
    if (std::sscanf(name.c_str(), "step_%lld%n", &step, &used) == 1 &&
        name.compare(static_cast<size_t>(used), std::string::npos, ".pt") == 0) {
      out.emplace_back(step, checkpoint_dir(run_dir) + "/" + name);
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

void write_text_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp" + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text;
    out.flush();
    if (!out.good()) throw std::runtime_error("cannot write " + tmp);
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) throw std::runtime_error("cannot rename " + tmp + " to " + path + ": " + ec.message());
}

std::string newest_run_dir(const std::string& name) {
  std::string best;
  for (const auto& entry : list_dir("runs")) {
    if (entry.rfind(name + "-", 0) == 0 && is_dir("runs/" + entry)) best = "runs/" + entry;
  }
  return best;
}

std::string new_run_dir(const std::string& name) {
  const std::time_t now = std::time(nullptr);
  std::tm tm {};
  ::localtime_r(&now, &tm);
  char stamp[32];
  std::strftime(stamp, sizeof(stamp), "%Y%m%d-%H%M%S", &tm);
  const std::string base = "runs/" + (name.empty() ? std::string("run") : name) + "-" + stamp;
  std::string dir = base;
  for (int i = 2; is_dir(dir); ++i) dir = base + "-" + std::to_string(i);
  return dir;
}

RunPlan plan_run(Config& config, const std::string& resume) {
  RunPlan plan;
  std::string run_dir = config.get_string("output.run_dir");
  if (resume == "auto") {
    const std::string name = config.name().empty() ? "run" : config.name();
    const bool given = !run_dir.empty();
    if (!given) run_dir = newest_run_dir(name);
    int64_t step = 0;
    if (!run_dir.empty()) {
      // The newest checkpoint that reads back whole (writes are atomic, but
      // a file may have been copied in torn).
      const auto found = checkpoints_in(run_dir);
      for (auto it = found.rbegin(); it != found.rend() && plan.checkpoint.empty(); ++it) {
        try {
          read_checkpoint(it->second);
          plan.checkpoint = it->second;
          step = it->first;
        } catch (const CheckpointError& e) {
          std::cerr << "fusetrain train: warning: skipping " << it->second << ": " << e.what()
                    << "\n";
        }
      }
    }
    const std::string which = given ? run_dir + " (output.run_dir)"
                                     : run_dir + ", the newest run of config \"" + name + "\"";
    if (!plan.checkpoint.empty()) {
      plan.resume_note = "--resume auto: resuming " + which + " at step " + std::to_string(step) +
                         " from " + plan.checkpoint;
    } else if (!run_dir.empty()) {
      plan.resume_note = "--resume auto: " + which + " has no checkpoint to resume from: training "
                         "it from the start";
    } else {
      plan.resume_note = "--resume auto: no run of config \"" + name + "\" to resume (no runs/" +
                         name + "-* directory here): starting a new one";
    }
  } else if (!resume.empty()) {
    if (!is_file(resume)) {
      throw UsageError("--resume " + resume + ": no such checkpoint file (--resume auto picks the "
                       "newest checkpoint of the newest run)");
    }
    plan.checkpoint = resume;
    if (run_dir.empty() && base_of(parent_of(resume)) == "checkpoints") {
      run_dir = parent_of(parent_of(resume));
    }
  }
  if (run_dir.empty()) run_dir = new_run_dir(config.name());
  config.set("output.run_dir", run_dir, "resolved");
  plan.run_dir = run_dir;
  if (!plan.checkpoint.empty()) read_checkpoint(plan.checkpoint);
  return plan;
}

const std::vector<std::string>& per_host_keys() {
  static const std::vector<std::string> keys = {"data.path",        "runtime.threads",
                                                "runtime.node_rank", "runtime.master_addr",
                                                "output.progress",  "output.run_dir"};
  return keys;
}

void check_same_config(const Config& config, const Distributed& world) {
  if (!world.is_distributed()) return;
  const auto& skip = per_host_keys();
  std::string mine;
  for (const auto& spec : config_schema()) {
    if (std::find(skip.begin(), skip.end(), spec.key) != skip.end()) continue;
    mine += spec.key + "=" + config.get_string(spec.key) + "\n";
  }
  const std::vector<std::string> all = world.allgather_text(mine);
  std::vector<int> differ;
  for (int r = 1; r < static_cast<int>(all.size()); ++r) {
    if (all[r] != all[0]) differ.push_back(r);
  }
  if (differ.empty()) return;
  // Name the first key on which the first differing rank departs from rank 0.
  const auto lines = [](const std::string& text) {
    std::vector<std::string> out;
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);) out.push_back(line);
    return out;
  };
  const auto a = lines(all[0]);
  const auto b = lines(all[differ.front()]);
  std::string detail;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    if (a[i] == b[i]) continue;
    const std::string key = a[i].substr(0, a[i].find('='));
    detail = key + " is " + a[i].substr(key.size() + 1) + " on rank 0 but " +
             b[i].substr(b[i].find('=') + 1) + " on rank " + std::to_string(differ.front());
    break;
  }
  std::string ranks;
  for (int r : differ) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  throw UsageError("the ranks were started with different configurations: rank" +
                   std::string(differ.size() > 1 ? "s " : " ") + ranks +
                   (differ.size() > 1 ? " differ" : " differs") + " from rank 0 (" +
                   detail + "). Every rank must run the same config; only data.path, "
                   "runtime.threads, runtime.node_rank, runtime.master_addr, output.progress "
                   "and output.run_dir may differ (rank 0's run directory is used)");
}

RunPlan agree_on_plan(Config& config, const std::string& resume, const Distributed& world) {
  if (!world.is_distributed()) return plan_run(config, resume);
  // Rank 0's plan, or its error, as "ok\nRUN_DIR\nCHECKPOINT" / "usage|checkpoint|error\nMESSAGE".
  std::string message;
  std::string note;  // rank 0's, which alone says it
  if (world.rank() == 0) {
    try {
      const RunPlan plan = plan_run(config, resume);
      note = plan.resume_note;
      message = "ok\n" + plan.run_dir + "\n" + plan.checkpoint;
    } catch (const UsageError& e) {
      message = std::string("usage\n") + e.what();
    } catch (const CheckpointError& e) {
      message = std::string("checkpoint\n") + e.what();
    } catch (const std::exception& e) {
      message = std::string("error\n") + e.what();
    }
  }
  message = world.broadcast_text(message);
  const size_t first = message.find('\n');
  const std::string kind = message.substr(0, first);
  const std::string rest = first == std::string::npos ? "" : message.substr(first + 1);
  const std::string from0 = world.rank() == 0 ? "" : "rank 0: ";
  if (kind == "usage") throw UsageError(from0 + rest);
  if (kind == "checkpoint") throw CheckpointError(from0 + rest);
  if (kind != "ok") throw std::runtime_error(from0 + rest);
  RunPlan plan;
  plan.run_dir = rest.substr(0, rest.find('\n'));
  plan.checkpoint = rest.substr(plan.run_dir.size() + 1);
  plan.resume_note = note;
  config.set("output.run_dir", plan.run_dir, "rank 0");
  // Every rank reads the checkpoint itself: the run directory must be on a
  // filesystem all hosts share.
  std::string problem;
  if (world.rank() != 0 && !plan.checkpoint.empty()) {
    try {
      read_checkpoint(plan.checkpoint);
    } catch (const std::exception& e) {
      problem = e.what();
    }
  }
  const std::vector<std::string> problems = world.allgather_text(problem);
  for (int r = 0; r < static_cast<int>(problems.size()); ++r) {
    if (problems[r].empty()) continue;
    throw CheckpointError("rank " + std::to_string(r) + " cannot read the checkpoint " +
                          plan.checkpoint + " that rank 0 resumes from (" + problems[r] +
                          "); resuming across hosts needs output.run_dir on a filesystem every "
                          "host shares");
  }
  return plan;
}

Config config_from_checkpoint(const std::string& path) {
  const TensorDict ckpt = read_checkpoint(path);
  Config config = Config::from_yaml(tensor_text(checkpoint_entry(ckpt, "config.yaml", path)),
                                    path + " (its stored config)");
  config.set_name(tensor_text(checkpoint_entry(ckpt, "config.name", path)));
  return config;
}

void prepare_run_dir(const Config& config, const RunPlan& plan) {
  make_dirs(checkpoint_dir(plan.run_dir));
  // What a writer killed mid-checkpoint left (step_N.pt.tmpPID).
  for (const auto& name : list_dir(checkpoint_dir(plan.run_dir))) {
    if (name.rfind("step_", 0) == 0 && name.find(".pt.tmp") != std::string::npos) {
      std::error_code ec;
      fs::remove(checkpoint_dir(plan.run_dir) + "/" + name, ec);
    }
  }
  write_text_atomically(plan.run_dir + "/config.yaml",
                        "# fusetrain train: the resolved configuration of this run\n" + config.to_yaml());
}

}  // namespace fusetrain::trainer
