// metrics.jsonl on disk.
#include "metrics.h"

#include "run_dir.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

extern char** environ;

namespace fusetrain::trainer {

void MetricsLog::open(const std::string& path, int64_t keep_through_step) {
  std::string kept;
  if (keep_through_step > 0 && is_file(path)) {
    std::ifstream in(path);
    for (std::string line; std::getline(in, line);) {
      // A line cut short by a crash is not valid JSON: dropped with the rest.
      const Record r = Record::parse(line, nullptr, /*allow_exceptions=*/false);
      if (r.is_object() && r.contains("step") && r["step"].is_number_integer() &&
          r["step"].get<int64_t>() <= keep_through_step) {
        kept += line + "\n";
      }
    }
  }
  write_text_atomically(path, kept);
  out_.open(path, std::ios::app);
  if (!out_.is_open()) throw std::runtime_error("cannot append to " + path);
}

void MetricsLog::write(const Record& record) {
  out_ << record.dump() << "\n";
  out_.flush();
}

namespace {

// The Python that draws the curves: $FUSETRAIN_PYTHON; else the project's
// virtual environment beside a build tree (build/fusetrain ->
// .venv/bin/python), whose torch and matplotlib `make` installed, with the
// source tree's python/ put first on its PYTHONPATH (`pythonpath`) so that it
// imports this checkout's fusetrain; else python3 from PATH (an installed
// fusetrain).
std::string plot_python(std::string* pythonpath) {
  const char* env = std::getenv("FUSETRAIN_PYTHON");
  if (env != nullptr && *env != '\0') return env;
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return "python3";
  for (std::filesystem::path dir = exe.parent_path(); !dir.empty() && dir != dir.root_path();
       dir = dir.parent_path()) {
    const std::filesystem::path venv = dir / ".venv" / "bin" / "python";
    if (::access(venv.c_str(), X_OK) != 0) continue;
    const std::filesystem::path source = dir / "python";
    if (std::filesystem::exists(source / "fusetrain" / "plot.py", ec)) {
      const char* old = std::getenv("PYTHONPATH");
      *pythonpath = source.string() + (old != nullptr && *old != '\0' ? ":" + std::string(old) : "");
    }
    return venv.string();
  }
  return "python3";
}

}  // namespace

std::string draw_curves(const std::string& run_dir, double timeout_s, std::string* why) {
  std::string pythonpath;
  const std::string python = plot_python(&pythonpath);
  const std::string image = run_dir + "/curves.png";
  const std::string log = run_dir + "/curves.log";
  std::vector<std::string> args = {python, "-m", "fusetrain.plot", run_dir, "-o", image};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  // The plotter's output goes to curves.log, not into the run's own output.
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  pid_t pid = 0;
  // This environment, with PYTHONPATH replaced where plot_python() set one.
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    if (pythonpath.empty() || std::strncmp(*e, "PYTHONPATH=", 11) != 0) env_strings.emplace_back(*e);
  }
  if (!pythonpath.empty()) env_strings.push_back("PYTHONPATH=" + pythonpath);
  std::vector<char*> envp;
  for (auto& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  const int rc = posix_spawnp(&pid, python.c_str(), &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    *why = python + " could not be started (" + std::strerror(rc) + "); set FUSETRAIN_PYTHON";
    return "";
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  int status = 0;
  while (true) {
    const pid_t done = waitpid(pid, &status, WNOHANG);
    if (done == pid) break;
    if (done < 0 && errno != EINTR) {
      *why = std::string("waiting for the plotter failed: ") + std::strerror(errno);
      return "";
    }
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      *why = python + " -m fusetrain.plot took over " + std::to_string(static_cast<int>(timeout_s)) +
             " s; stopped";
      return "";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0 && std::filesystem::exists(image)) {
    std::filesystem::remove(log);
    return image;
  }
  // The last line the plotter printed says why (no module fusetrain, no matplotlib, ...).
  std::ifstream in(log);
  std::string line, last;
  while (std::getline(in, line)) {
    if (!line.empty()) last = line;
  }
  *why = python + " -m fusetrain.plot failed" + (last.empty() ? "" : ": " + last) + " (" + log +
         "; FUSETRAIN_PYTHON names a Python with fusetrain and matplotlib)";
  return "";
}

}  // namespace fusetrain::trainer
