// The communication thread on the CPU, with a fake backend: the issue-order rule of
// comm.h (Comms that share a thread issue in the program's order, which nccl needs),
// why a thread per Comm would not keep it, and operations that finish after their
// thread has moved on (nccl's kernels still running on the GPU). The fake records
// every operation as it reaches its "transport": which communicator, which
// operation, and the program's number for it (carried as the operation's count).
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <ostream>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common/comm/comm.h"
#include "common/train/metrics.h"

using namespace course;

namespace {

// One operation as the fake transport saw it.
struct Issue {
  int comm;  // the fake's id: the world is 0, a split group its color
  std::string operation;
  size_t number;  // the program's number for it
  bool operator==(const Issue& other) const {
    return comm == other.comm && operation == other.operation && number == other.number;
  }
};

std::ostream& operator<<(std::ostream& out, const Issue& issue) {
  return out << "{comm " << issue.comm << ", " << issue.operation << " #" << issue.number << "}";
}

// What the fake's operations carry from do_* to finished().
struct FakeTicket : OpTicket {
  Issue issue{-1, "", 0};
  double done_at = 0.0;  // when the "device" is done with it (now_seconds())
  int asked = 0;         // finished() calls so far
};

// What the fake Comms of one test share: the issues in the order they happened, and
// the hooks that say what an operation costs.
class Transport {
 public:
  explicit Transport(unsigned seed) : random_(seed) {}

  // On a comm thread, before the operation reaches the transport. By default a
  // random short time, as a real transport takes.
  std::function<void(const Issue&)> before_issue = [this](const Issue&) { sleep_random(); };
  // On a comm thread: whether the operation is over (on the "device"). By default
  // never at the first ask, then once a random short time has passed.
  std::function<bool(const FakeTicket&)> over = [](const FakeTicket& ticket) {
    return ticket.asked > 1 && now_seconds() >= ticket.done_at;
  };

  // Records the issue, and when the device will be done with it.
  void issue(FakeTicket& ticket) {
    before_issue(ticket.issue);
    ticket.done_at = now_seconds() + random_microseconds() * 1e-6;
    std::lock_guard<std::mutex> lock(mutex_);
    issues_.push_back(ticket.issue);
    issued_.notify_all();
  }

  std::vector<Issue> issues() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return issues_;
  }

  // Waits until `count` operations have been issued, up to `seconds`.
  bool wait_for_issues(size_t count, double seconds) {
    std::unique_lock<std::mutex> lock(mutex_);
    return issued_.wait_for(lock, std::chrono::duration<double>(seconds), [&] { return issues_.size() >= count; });
  }

  bool issued_after(size_t number) const {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const Issue& issue : issues_) {
      if (issue.number > number) return true;
    }
    return false;
  }

 private:
  int random_microseconds() {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::uniform_int_distribution<int>(0, 300)(random_);
  }
  void sleep_random() { std::this_thread::sleep_for(std::chrono::microseconds(random_microseconds())); }

  mutable std::mutex mutex_;
  std::condition_variable issued_;
  std::vector<Issue> issues_;
  std::mt19937 random_;
};

// A Comm of one rank whose operations only tell the transport. With `thread` it
// shares that communication thread, as nccl's Comms do, and so do its splits;
// without, every Comm has its own, as tcp's and mpi's do.
class FakeComm : public Comm {
 public:
  FakeComm(int id, std::shared_ptr<Transport> transport, std::shared_ptr<CommThread> thread)
      : Comm(0, 1, kTimeoutSeconds, thread), id_(id), transport_(std::move(transport)), shared_(std::move(thread)) {}
  ~FakeComm() override { stop_thread(); }

  std::string backend() const override { return "fake"; }

  static constexpr double kTimeoutSeconds = 10.0;

 protected:
  std::shared_ptr<OpTicket> issue_ticket(const std::string&) override { return std::make_shared<FakeTicket>(); }
  void do_all_reduce(void*, size_t count, DType, ReduceOp, OpStats&) override { issue("all_reduce", count); }
  void do_broadcast(float*, size_t count, int, OpStats&) override { issue("broadcast", count); }
  // the key carries the program's number; the color is the group's id
  std::unique_ptr<Comm> do_split(int color, int key) override {
    issue("split", static_cast<size_t>(key));
    return std::make_unique<FakeComm>(color, transport_, shared_);
  }
  void do_reduce_scatter(const void*, void*, const std::vector<size_t>&, DType, ReduceOp, OpStats&) override {
    unused();
  }
  void do_all_gather(const void*, void*, const std::vector<size_t>&, DType, OpStats&) override { unused(); }
  void do_all_to_all(const void*, const std::vector<size_t>&, void*, const std::vector<size_t>&, DType,
                     OpStats&) override {
    unused();
  }
  void do_send_recv(const void*, size_t, int, void*, size_t, int, DType, OpStats&) override { unused(); }
  void do_barrier(OpStats&) override { unused(); }

  bool finished(OpTicket* ticket, double started) override {
    auto& fake = static_cast<FakeTicket&>(*ticket);
    fake.asked++;
    if (transport_->over(fake)) return true;
    if (now_seconds() - started > kTimeoutSeconds) {
      throw CommError(describe(fake.issue.operation) + ": timed out on the fake device (hint: the comm thread " +
                      "never issued what this operation waits for)");
    }
    return false;
  }

 private:
  void issue(const std::string& operation, size_t number) {
    auto& ticket = static_cast<FakeTicket&>(*running_ticket());
    ticket.issue = {id_, operation, number};
    transport_->issue(ticket);
  }
  [[noreturn]] void unused() { throw CommError(describe("an operation") + " that these tests do not use"); }

  int id_;
  std::shared_ptr<Transport> transport_;
  std::shared_ptr<CommThread> shared_;
};

unsigned test_seed() { return std::random_device{}(); }

// A world (0) and its groups 1..groups, made by split, sharing one thread or not.
struct FakeWorld {
  std::shared_ptr<Transport> transport;
  std::unique_ptr<Comm> world;
  std::vector<std::unique_ptr<Comm>> groups;  // groups[g - 1] is group g; destroyed before the world
  std::vector<Issue> program;                 // what the program queued, in order

  FakeWorld(unsigned seed, bool shared_thread, int group_count)
      : transport(std::make_shared<Transport>(seed)),
        world(std::make_unique<FakeComm>(0, transport, shared_thread ? std::make_shared<CommThread>() : nullptr)) {
    for (int g = 1; g <= group_count; g++) {
      groups.push_back(world->split(g, static_cast<int>(number("split", 0))));
    }
  }
  Comm& comm(int id) { return id == 0 ? *world : *groups.at(id - 1); }

  // The program's next number, for an operation on `comm`.
  size_t number(const std::string& operation, int comm) {
    program.push_back({comm, operation, program.size()});
    return program.back().number;
  }
  Work all_reduce(int id) { return comm(id).all_reduce_async(static_cast<float*>(nullptr), number("all_reduce", id)); }
  Work broadcast(int id) { return comm(id).broadcast_async(nullptr, number("broadcast", id), 0); }
};

// Every Work waited, in order; what each returned, by communicator.
std::vector<std::vector<OpInterval>> wait_all(std::vector<std::pair<int, Work>>& works, int comms) {
  std::vector<std::vector<OpInterval>> spans(comms);
  for (auto& [id, work] : works) spans[id].push_back(work.wait());
  return spans;
}

// One Comm's operations ran one after another: each span starts after the last ended.
void check_one_at_a_time(const std::vector<OpInterval>& spans) {
  for (size_t i = 0; i < spans.size(); i++) {
    CHECK(spans[i].end >= spans[i].start);
    if (i > 0) CHECK(spans[i].start >= spans[i - 1].end);
  }
}

}  // namespace

TEST_CASE("comm issue order: Comms that share a thread issue in the program's order, whatever each one takes",
          "[comm]") {
  const unsigned seed = test_seed();
  INFO("seed " << seed);
  // a world and three groups split from it, as chapter 07's TP, pipeline and DP groups
  FakeWorld fake(seed, /*shared_thread=*/true, 3);
  std::vector<std::pair<int, Work>> works;
  for (int i = 0; i < 240; i++) {
    // hop between the communicators in an irregular pattern, as a step's phases do
    const int id = (i * 7 + i / 5) % 4;
    works.emplace_back(id, i % 3 == 0 ? fake.broadcast(id) : fake.all_reduce(id));
    // now and then a blocking one, which is an asynchronous one plus wait()
    if (i % 25 == 24) fake.comm(i % 4).all_reduce(static_cast<float*>(nullptr), fake.number("all_reduce", i % 4));
  }
  const std::vector<std::vector<OpInterval>> spans = wait_all(works, 4);

  // every rank runs this program, so every rank issues in this one order
  CHECK(fake.transport->issues() == fake.program);
  for (const auto& comm_spans : spans) check_one_at_a_time(comm_spans);
  // every operation counted once, blocking ones (asynchronous ones plus wait) too
  const auto on_world = std::count_if(fake.program.begin(), fake.program.end(),
                                      [](const Issue& issue) { return issue.comm == 0 && issue.operation != "split"; });
  CHECK(fake.world->stats().at("all_reduce").calls + fake.world->stats().at("broadcast").calls ==
        static_cast<uint64_t>(on_world));
}

TEST_CASE("comm issue order: with a thread per Comm, an operation queued later can be issued first", "[comm]") {
  // Group 1's operation, queued first, is held up before it reaches the transport
  // (a slow connection, a busy peer) until the world's operation, queued second, has
  // been issued. With a thread per Comm the world's thread issues it meanwhile, so
  // this rank issues world-then-group while a rank not held up issues group-then-
  // world: with NCCL, two kernels that wait for each other's peers. With one shared
  // thread the world's operation waits its turn, and the order is the program's.
  for (const bool shared_thread : {false, true}) {
    INFO((shared_thread ? "one thread for all" : "a thread per Comm"));
    FakeWorld fake(test_seed(), shared_thread, 1);
    // A shared thread cannot issue the world's operation before this one: wait a
    // little only (it then goes on, in order). Apart, the world's thread issues it at once.
    const double hold_up_seconds = shared_thread ? 0.05 : FakeComm::kTimeoutSeconds;
    // (the hooks are replaced while nothing is in flight: the comm threads are idle)
    fake.transport->before_issue = [&](const Issue& issue) {
      if (issue.comm == 1) fake.transport->wait_for_issues(2, hold_up_seconds);  // the split and the world's
    };
    std::vector<std::pair<int, Work>> works;
    works.emplace_back(1, fake.all_reduce(1));
    works.emplace_back(0, fake.all_reduce(0));
    wait_all(works, 2);

    const std::vector<Issue> issued = fake.transport->issues();
    REQUIRE(issued.size() == 3);  // the split, then the two
    if (shared_thread) {
      CHECK(issued == fake.program);
    } else {
      CHECK(issued[1] == fake.program[2]);
      CHECK(issued[2] == fake.program[1]);
    }
  }
}

TEST_CASE("comm thread: it issues the next operation while the previous one still runs, and finishes them in order",
          "[comm]") {
  FakeWorld fake(test_seed(), /*shared_thread=*/true, 1);
  // An all-reduce on the "device" is over only once a later operation has been
  // issued (the last one at once). A thread that waited for each operation before
  // issuing the next would never see one over, and fail at the fake's deadline.
  const size_t last = fake.program.size() + 2 * 20;  // the number of the last all-reduce below
  fake.transport->over = [&](const FakeTicket& ticket) {
    const Issue& issue = ticket.issue;
    return issue.operation != "all_reduce" || issue.number >= last || fake.transport->issued_after(issue.number);
  };
  std::vector<std::pair<int, Work>> works;
  for (int i = 0; i < 20; i++) {
    works.emplace_back(0, fake.all_reduce(0));
    works.emplace_back(1, fake.broadcast(1));
  }
  works.emplace_back(0, fake.all_reduce(0));
  REQUIRE(fake.program.back().number == last);
  const std::vector<std::vector<OpInterval>> spans = wait_all(works, 2);

  CHECK(fake.transport->issues() == fake.program);
  check_one_at_a_time(spans[0]);
  check_one_at_a_time(spans[1]);
  CHECK(fake.world->stats().at("all_reduce").calls == 21);
}

TEST_CASE("comm thread: an operation that fails on the device breaks its own Comm only", "[comm]") {
  FakeWorld fake(test_seed(), /*shared_thread=*/true, 1);
  const size_t faulty = fake.program.size() + 2;  // the third operation below
  fake.transport->over = [faulty](const FakeTicket& ticket) -> bool {
    if (ticket.issue.number == faulty) throw CommError("rank 0 all_reduce: a fake device fault (hint: none, it is a test)");
    return true;
  };
  Work before = fake.all_reduce(0);
  Work other = fake.broadcast(1);
  Work failing = fake.all_reduce(0);
  REQUIRE(fake.program.back().number == faulty);
  Work other_after = fake.broadcast(1);

  CHECK_NOTHROW(before.wait());
  CHECK_NOTHROW(other.wait());
  CHECK_THROWS_WITH(failing.wait(), Catch::Contains("a fake device fault"));
  CHECK_NOTHROW(other_after.wait());
  // the world is broken: what is queued now fails at once, naming the first error
  CHECK_THROWS_WITH(fake.all_reduce(0).wait(),
                    Catch::Contains("not started") && Catch::Contains("a fake device fault"));
  // the group, on the same thread, goes on
  CHECK_NOTHROW(fake.broadcast(1).wait());
}

TEST_CASE("comm thread: call runs after what was posted before it, and throws what its work threw", "[comm]") {
  CommThread thread;
  std::vector<int> ran;  // only the comm thread writes it, and call() returns after it did
  for (int i = 0; i < 5; i++) thread.post([&ran, i] { ran.push_back(i); });
  thread.call([&ran] { ran.push_back(5); });
  CHECK(ran == std::vector<int>{0, 1, 2, 3, 4, 5});
  CHECK_THROWS_WITH(thread.call([] { throw std::runtime_error("from the comm thread"); }), "from the comm thread");
}
