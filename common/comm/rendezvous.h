// Where the ranks of a job meet: the store at MASTER_ADDR.
//
// The tcp and nccl backends find each other through the store (store.h): a rank
// publishes what the others need from it (where it listens, NCCL's unique id) and
// reads what they published. The course launcher hosts the store on
// COURSE_STORE_PORT; torchrun's agent hosts a c10d TCPStore on MASTER_PORT
// (c10d_store.h); without either (variables set by hand, or a lone process) rank 0
// hosts the store for the job on MASTER_PORT (env.h).
#pragma once

#include <memory>

#include "common/comm/env.h"
#include "common/comm/store.h"

namespace course {

struct Rendezvous {
  std::shared_ptr<StoreServer> server;  // the store this rank hosts (rank 0 when the launcher hosts none), else null
  std::shared_ptr<Store> client;        // this rank's connection to the store
  std::string secret;                   // the job's secret, which peers must prove they hold (auth.h); "" = none
  std::string listen_host;              // where a rank listens: 127.0.0.1 when every rank is on this machine
};

// Connects this rank to the job's store, hosting it first when this rank is the one
// to. Keep the result alive while other ranks may still need the store: rank 0's
// server goes when the last Rendezvous holding it does. Comms made one after another
// in one process share rank 0's server (a second one could not listen on the port).
// A lone process (world size 1, hosting its own store) needs no MASTER_ADDR/PORT.
// A job on one machine (world size == local world size) that meets at a loopback
// MASTER_ADDR listens on the loopback interface only: nothing outside the machine
// can even connect.
// UsageError: several ranks but no MASTER_ADDR or store port.
// CommError: the store cannot be reached within timeout_seconds.
Rendezvous connect_rendezvous(const LaunchEnv& env, double timeout_seconds);

}  // namespace course
