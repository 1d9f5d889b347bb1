#include "common/comm/rendezvous.h"

#include "common/comm/c10d_store.h"

#include <cstdio>
#include <map>
#include <mutex>
#include <string>

namespace course {

namespace {

// The store server this process hosts on `port`, started on first use. A Comm keeps
// its Rendezvous while it may need the store, so when a process makes several Comms
// (a tcp one and an nccl one, or a test making one after another) they must share
// the server: a second one could not listen on the same port. Port 0 (any free
// port, a lone process) always gets a new server.
std::shared_ptr<StoreServer> host_store(const std::string& host, int port, const std::string& secret) {
  static std::mutex mutex;
  static std::map<int, std::weak_ptr<StoreServer>> servers;  // by port; expired once every user is gone
  std::lock_guard<std::mutex> lock(mutex);
  if (port != 0) {
    if (std::shared_ptr<StoreServer> running = servers[port].lock()) return running;
  }
  auto server = std::make_shared<StoreServer>(host, port, secret);
  servers[server->port()] = server;
  return server;
}

}  // namespace

Rendezvous connect_rendezvous(const LaunchEnv& env, double timeout_seconds) {
  const bool hosts_store = env.store_host == StoreHost::RankZero && env.rank == 0;
  const bool alone = env.world_size == 1 && hosts_store;
  if (!alone && (env.master_addr.empty() || env.store_port <= 0)) {
    throw UsageError("rank " + std::to_string(env.rank) + " of " + std::to_string(env.world_size) +
                     ": the rendezvous needs MASTER_ADDR and MASTER_PORT (hint: start it with the course launcher, "
                     "or export both, the same on every rank)");
  }
  Rendezvous rendezvous;
  rendezvous.secret = env.job_secret;
  // Loopback only when every rank is on this machine and meets at a loopback
  // address (the course launcher's MASTER_ADDR for one node): ranks reach each
  // other at the address they reached the store at. Else every interface.
  const bool loopback_address = env.master_addr.empty() || env.master_addr == "localhost" ||
                                env.master_addr.rfind("127.", 0) == 0;
  const bool one_machine = env.world_size == env.local_world_size;
  rendezvous.listen_host = one_machine && loopback_address ? "127.0.0.1" : "0.0.0.0";
  if (hosts_store) rendezvous.server = host_store(rendezvous.listen_host, env.store_port, env.job_secret);
  // A lone process may have no address: it meets only itself, on its own server.
  const std::string host = env.master_addr.empty() ? "127.0.0.1" : env.master_addr;
  const int port = rendezvous.server != nullptr ? rendezvous.server->port() : env.store_port;
  if (env.store_host == StoreHost::TorchrunAgent) {
    if (env.rank == 0) {
      std::fprintf(stderr, "note: the ranks meet at torchrun's store, %s:%d, which asks for no secret: whatever "
                   "can reach that port can join this job (hint: the course launcher's store does ask)\n",
                   host.c_str(), port);
    }
    rendezvous.client = std::make_shared<C10dStoreClient>(host, port, timeout_seconds);
  } else {
    rendezvous.client = std::make_shared<StoreClient>(host, port, timeout_seconds, env.job_secret);
  }
  return rendezvous;
}

}  // namespace course
