// SPDX-License-Identifier: Apache-2.0
// The crash test: a child process resumes from the checkpoint, steps, and saves, telling the
// parent each operation of the save through a pipe; the parent kills it with SIGKILL or
// SIGTERM (preemption; its default action ends the process as abruptly) in a chosen phase
// (the writes, the file's fsync, the rename, the directory's fsync), 50 times in each: half
// the kills land exactly at an operation's start, half at a random moment (0-300 us) after
// it began. After every kill the checkpoint must load, hold exactly the state of the step it
// claims, and claim the step the save's phase allows: the previous one before the rename,
// the new one once the rename is done.
//
// And nothing is left behind: the save's temporary file is nameless until it is complete, so
// a kill leaves at most a name that exists for the instant between linking it and renaming
// it (only a kill in the rename phase, mid-operation, can land there), and the next save of
// the same checkpoint removes such a leftover of a dead process. The directory is checked
// after every kill, and must hold only the checkpoint at the end.
//
// SIGKILL leaves the page cache intact, so this checks atomicity, not durability against a
// power cut; the order of writes, fsync, rename and directory fsync that durability needs is
// asserted by test_checkpoint ("a save writes everything, fsyncs the file, ...").
#include "nvme_support.hpp"

#include <array>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <map>
#include <random>
#include <thread>

#include <csignal>
#include <sys/wait.h>
#include <unistd.h>

using namespace tierstate;
using namespace tierstate::test;

namespace {

using Opt = HostOpt<Bf16Mixed>;

struct event_message {
  std::uint8_t event;
  std::int64_t step;
};

Opt::options child_options()
{
  Opt::options o;
  o.chunk_elements = 2048;
  o.threads        = 1;
  return o;
}

/// The child: resume, step, save, step, save, ... telling every save operation.
[[noreturn]] void child(std::filesystem::path const& ckpt, int events, int go)
{
  try {
    nvme_model<Bf16Mixed> m;
    Opt opt(schedule<Opt>(1), child_options());
    register_model(opt, m);
    if (std::filesystem::exists(ckpt)) { opt.load(ckpt); }
    checkpoint_options o;
    o.observer = [&](save_event e, std::uint64_t, std::uint64_t) {
      event_message const msg{static_cast<std::uint8_t>(e), opt.step_count()};
      if (::write(events, &msg, sizeof(msg)) != static_cast<ssize_t>(sizeof(msg))) { std::_Exit(3); }
      char c = 0;
      if (::read(go, &c, 1) != 1) { std::_Exit(4); }  // the parent is gone
    };
    for (int t = static_cast<int>(opt.step_count()) + 1;; ++t) {
      m.fill_grads(t);
      opt.set_hyperparameters(0, schedule<Opt>(t));
      auto const views = m.views();
      opt.step(views);
      opt.save(ckpt, o);
    }
  } catch (std::exception const& e) {
    std::fprintf(stderr, "crash test child: %s\n", e.what());
    std::_Exit(2);
  }
}

/// Kills during steps and loads, and ends by exit and by exception: NvmeFile's scratch
/// directory and the checkpoint's directory must hold nothing new afterwards. Returns the
/// number of failures.
int leftovers_of_steps_and_loads(std::filesystem::path const& ckpt, std::mt19937& rng)
{
  using N = NvmeOpt<Bf16Mixed, Pipelined<2>>;
  scratch_dir scratch;
  auto const ckpt_dir = ckpt.parent_path();
  int failures = 0, kills = 0;
  enum class ending { sigkill_in_step, sigterm_in_step, sigkill_in_load, sigterm_in_load, exit, exception };
  auto run_child = [&](ending how) -> int {
    int ready[2];
    if (::pipe(ready) != 0) { return -1; }
    std::fflush(stdout);
    pid_t const pid = ::fork();
    if (pid == 0) {
      ::close(ready[0]);
      try {
        N::options o;
        o.chunk_elements = 2048;
        o.threads        = 1;
        o.tier.directory = scratch.path;
        nvme_model<Bf16Mixed> m;
        N opt(schedule<N>(1), o);
        register_model(opt, m);
        opt.load(ckpt);
        bool const loads = how == ending::sigkill_in_load || how == ending::sigterm_in_load;
        if (::write(ready[1], "r", 1) != 1) { std::_Exit(3); }
        for (int t = 1;; ++t) {
          if (loads) {
            opt.load(ckpt);
          } else {
            m.fill_grads(t);
            auto const v = m.views();
            opt.step(v);
          }
          if (how == ending::exit && t == 3) { std::exit(0); }  // destructors of statics, not of locals
          if (how == ending::exception && t == 3) { opt.load(scratch.path / "missing"); }
        }
      } catch (std::exception const&) {
        std::_Exit(0);  // the exception ended the work: what is left on disk is what counts
      }
    }
    ::close(ready[1]);
    char c = 0;
    bool const started = ::read(ready[0], &c, 1) == 1;
    ::close(ready[0]);
    int signal = 0;
    if (how == ending::sigkill_in_step || how == ending::sigkill_in_load) { signal = SIGKILL; }
    if (how == ending::sigterm_in_step || how == ending::sigterm_in_load) { signal = SIGTERM; }
    if (signal != 0 && started) {
      std::this_thread::sleep_for(std::chrono::microseconds(std::uniform_int_distribution<int>(0, 20000)(rng)));
      ::kill(pid, signal);
      ++kills;
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    return status;
  };
  for (int i = 0; i < 40; ++i) {
    auto const how = static_cast<ending>(i % 6);
    int const status = run_child(how);
    bool const killed = how != ending::exit && how != ending::exception;
    if (killed ? !WIFSIGNALED(status) : !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
      std::printf("FAIL: leftovers case %d ended with status %d\n", i, status);
      ++failures;
    }
    if (!scratch.entries().empty()) {
      std::printf("FAIL: leftovers case %d left '%s' in the scratch directory\n", i, scratch.entries().front().c_str());
      ++failures;
    }
    std::vector<std::string> extra;
    for (auto const& n : std::filesystem::directory_iterator(ckpt_dir)) {
      if (n.path().filename() != ckpt.filename()) { extra.push_back(n.path().filename().string()); }
    }
    if (!extra.empty()) {
      std::printf("FAIL: leftovers case %d left '%s' beside the checkpoint\n", i, extra.front().c_str());
      ++failures;
    }
  }
  std::printf("leftovers: %d kills in steps and loads (SIGKILL and SIGTERM), exits and exceptions: %d failures\n",
              kills, failures);
  return failures;
}

}  // namespace

int main()
{
  scratch_dir d;
  auto const ckpt = d.path / "c";
  std::array<save_event, 4> const phases = {save_event::write, save_event::fsync_file, save_event::rename,
                                            save_event::fsync_directory};
  int const kills_per_phase = 50;
  std::map<save_event, int> kills;
  std::mt19937 rng(20261129);

  // The reference: the same training without crashes, snapshot at each step count asked.
  nvme_model<Bf16Mixed> ref_model;
  Opt ref(schedule<Opt>(1), child_options());
  register_model(ref, ref_model);
  auto reference_at = [&](std::int64_t s) {
    for (auto t = ref.step_count() + 1; t <= s; ++t) {
      ref_model.fill_grads(static_cast<int>(t));
      ref.set_hyperparameters(0, schedule<Opt>(static_cast<int>(t)));
      auto const views = ref_model.views();
      ref.step(views);
    }
    return snapshot(ref, ref_model);
  };

  // A first checkpoint, at step 1, so that every kill has one to fall back on.
  {
    nvme_model<Bf16Mixed> m;
    Opt first(schedule<Opt>(1), child_options());
    register_model(first, m);
    m.fill_grads(1);
    auto const views = m.views();
    first.step(views);
    first.save(ckpt);
  }
  std::int64_t on_disk = 1;  // the step of the checkpoint on disk
  int failures = 0, verified = 0, leftovers = 0, sigterms = 0;
  for (int i = 0; i < kills_per_phase * static_cast<int>(phases.size()); ++i) {
    save_event const target = phases[static_cast<std::size_t>(i) % phases.size()];
    bool const mid_op       = (i / static_cast<int>(phases.size())) % 2 == 1;
    int const signal        = (i / (2 * static_cast<int>(phases.size()))) % 2 == 1 ? SIGTERM : SIGKILL;
    int events[2], go[2];
    if (::pipe(events) != 0 || ::pipe(go) != 0) {
      std::perror("pipe");
      return 1;
    }
    std::fflush(stdout);
    pid_t const pid = ::fork();
    if (pid == 0) {
      ::close(events[0]);
      ::close(go[1]);
      child(ckpt, events[1], go[0]);
    }
    ::close(events[1]);
    ::close(go[0]);
    // Which write of the save to kill in (header, chunks, table: 23 writes here).
    int const write_target = std::uniform_int_distribution<int>(1, 23)(rng);
    int writes_seen        = 0;
    bool killed            = false;
    event_message msg{};
    while (!killed && ::read(events[0], &msg, sizeof(msg)) == static_cast<ssize_t>(sizeof(msg))) {
      auto const e = static_cast<save_event>(msg.event);
      if (e == save_event::write) { ++writes_seen; }
      bool const here = e == target && (e != save_event::write || writes_seen == write_target);
      if (!here) {
        if (::write(go[1], "c", 1) != 1) { break; }
        continue;
      }
      if (mid_op) {
        if (::write(go[1], "c", 1) != 1) { break; }
        std::this_thread::sleep_for(std::chrono::microseconds(std::uniform_int_distribution<int>(0, 300)(rng)));
      }
      ::kill(pid, signal);
      killed = true;
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    ::close(events[0]);
    ::close(go[1]);
    if (!killed || !WIFSIGNALED(status) || WTERMSIG(status) != signal) {
      std::printf("FAIL: kill %d (%s): the child ended otherwise (status %d)\n", i,
                  std::string(save_event_name(target)).c_str(), status);
      return 1;
    }
    ++kills[target];
    if (signal == SIGTERM) { ++sigterms; }

    // The checkpoint must load and be exactly the state of the step it claims: the old step,
    // or the new one if the rename may have happened.
    nvme_model<Bf16Mixed> m;
    Opt opt(schedule<Opt>(1), child_options());
    register_model(opt, m);
    try {
      opt.load(ckpt);
    } catch (std::exception const& e) {
      std::printf("FAIL: kill %d (%s, %s): %s\n", i, std::string(save_event_name(target)).c_str(),
                  mid_op ? "mid-operation" : "at its start", e.what());
      ++failures;
      continue;
    }
    std::int64_t const s = opt.step_count();
    // Before the rename the old checkpoint stands; after it, the new one; during it, either.
    bool const allowed = target == save_event::fsync_directory ? s == on_disk + 1
                         : target == save_event::rename && mid_op ? (s == on_disk || s == on_disk + 1)
                                                                  : s == on_disk;
    if (!allowed) {
      std::printf("FAIL: kill %d (%s): the checkpoint holds step %lld; step %lld was on disk before\n", i,
                  std::string(save_event_name(target)).c_str(), static_cast<long long>(s),
                  static_cast<long long>(on_disk));
      ++failures;
    } else if (!(snapshot(opt, m) == reference_at(s))) {
      std::printf("FAIL: kill %d: the checkpoint of step %lld does not hold that step's state\n", i,
                  static_cast<long long>(s));
      ++failures;
    } else {
      ++verified;
    }
    on_disk = s;
    // What the kill left: at most the name of this save's finished file, and only from a kill
    // between its link and its rename; never an earlier kill's (the next save removed it).
    std::vector<std::string> extra;
    for (auto const& name : d.entries()) {
      if (name != "c") { extra.push_back(name); }
    }
    leftovers += static_cast<int>(extra.size());
    if (extra.size() > 1 || (!extra.empty() && !(target == save_event::rename && mid_op))) {
      std::printf("FAIL: kill %d (%s, %s) left %zu file(s) beside the checkpoint, the first '%s'\n", i,
                  std::string(save_event_name(target)).c_str(), mid_op ? "mid-operation" : "at its start",
                  extra.size(), extra.front().c_str());
      ++failures;
      for (auto const& name : extra) { std::filesystem::remove(d.path / name); }
    }
  }
  // One more save of the checkpoint: it removes what a dead process's save left.
  {
    nvme_model<Bf16Mixed> m;
    Opt last(schedule<Opt>(1), child_options());
    register_model(last, m);
    last.load(ckpt);
    last.save(ckpt);
  }
  if (d.entries() != std::vector<std::string>{"c"}) {
    std::printf("FAIL: after the last save the directory holds %zu entries, not just the checkpoint\n",
                d.entries().size());
    ++failures;
  }
  int total = 0;
  for (auto const& [e, n] : kills) { total += n; }
  std::printf("crash test: %d kills, %d of them SIGTERM (", total, sigterms);
  for (auto const& [e, n] : kills) { std::printf("%s %d, ", std::string(save_event_name(e)).c_str(), n); }
  std::printf("half at an operation's start, half mid-operation); %d checkpoints loaded and verified, "
              "%d failures; %d names left by kills between a save's link and its rename, each removed by the next "
              "save; last step %lld\n",
              verified, failures, leftovers, static_cast<long long>(on_disk));
  failures += leftovers_of_steps_and_loads(ckpt, rng);
  return failures == 0 && on_disk > 1 ? 0 : 1;
}
