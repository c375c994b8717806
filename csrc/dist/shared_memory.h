// Collectives through shared memory for ranks on one host (Note [Shared-memory
// allreduce]): a c10d backend that takes the allreduces, all-gathers,
// reduce-scatters and broadcasts of CPU tensors itself and hands every other
// collective to gloo.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

namespace c10d {
class Backend;
class ProcessGroup;
class Store;
}  // namespace c10d

namespace fusetrain::dist {

// Note [Shared-memory allreduce]
// gloo moves an allreduce over TCP even when every rank is on one host: on
// the 2-core default run a 0.9 MB gradient allreduce costs 2-3 ms of a
// 27 ms step, on gloo's own threads, which compete with the ranks' compute
// for the same cores. When the ranks share a host (same boot, and the same
// network, PID, mount and IPC namespaces: ranks in network namespaces of
// their own count as other hosts), they map one POSIX shared-memory segment
// instead, with two slot sets of `slot_bytes` per rank used alternately.
// A tensor goes through in chunks of one slot: every rank copies its chunk
// in; after a barrier each rank reduces one W-th of the chunk across all
// slots in rank order (16-bit types accumulate in float32 and round once)
// and writes it back into its own slot; after a second barrier every rank
// copies the whole reduced chunk out. Each element is reduced by one rank
// only, so every rank gets the same bits (for two ranks, the bits gloo
// gives). The alternating slot sets let the next chunk start after two
// barriers, not three.
//
// The same segment serves the collectives ZeRO (Note [Sharded optimizer
// state] in zero.h) and torch's ZeroRedundancyOptimizer move shards with,
// one barrier a chunk each: all_gather_into_tensor and all_gather (each
// rank copies its chunk in, then the others' out: any dtype), broadcast (the
// root copies in, the others out), and reduce_scatter_tensor (each rank
// copies in the sub-chunks the others reduce, then reduces its own piece
// from every slot in rank order, as the allreduce does: the same bits as
// the allreduce of the whole tensor, at a third of its copies). In gloo on 2
// ranks over loopback a 37.8 MB all-gather of the default bench's 9.45M
// parameters took 22-40 ms of each step (two broadcasts).
//
// The collective runs on the calling thread and the returned work is
// complete: on CPUs the ranks fill the cores, and a communication thread
// would only take time from them. A barrier spins for a few microseconds,
// then sleeps on a futex; a wait longer than the group's timeout, or a peer
// process that has exited, fails this collective and every later one with
// an error that names the rank. At its first chunk each rank also writes
// what it runs (collective, bytes, dtype, reduction, root) beside its slot
// and, after the barrier, compares the others': calls that do not match
// fail on every rank at once, naming both, where pairing the barriers of
// different collectives would move wrong data silently. An error outside
// the segment (allocating, copying into an output whose elements share
// memory) fails that call alone: the ranks are still in step. Which path a
// call takes depends only on what every rank of a correct program shares
// (collective, dtype, sizes, op, root), never on one rank's strides or
// pointers. Strided views go through a dense copy (gloo would reduce the
// first numel() elements of their memory instead). The rest (other
// collectives, sparse or several tensors, overlapping allreduce outputs,
// bitwise reductions, AVG of integers, other dtypes of a reduction) goes to
// gloo, in the caller's order as before.

/// An identity of this host as the shared-memory allreduce sees it: equal
/// for two processes exactly when they can share a segment (boot id and the
/// network, PID, mount and IPC namespaces).
std::string shared_memory_host_identity();

/// The CPU backend for a group whose ranks are all on this host: a
/// shared-memory allreduce in front of `fallback` (gloo). Every rank calls it
/// with the group's store; the ranks agree through it and all get a backend,
/// or all get nullptr (ranks on several hosts, more than 256 ranks, or a
/// segment that could not be created or mapped on some rank: then gloo
/// alone serves the group, and a warning says why on rank 0).
c10::intrusive_ptr<c10d::Backend> make_shared_memory_backend(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
    std::chrono::milliseconds timeout, c10::intrusive_ptr<c10d::Backend> fallback,
    size_t slot_bytes = 0);

/// Whether `group`'s CPU collectives go through shared memory.
bool uses_shared_memory(const c10::intrusive_ptr<c10d::ProcessGroup>& group);

/// How many collectives of each kind `group`'s CPU backend has run through
/// shared memory, by torch.distributed's names ("all_reduce",
/// "all_gather_into_tensor", "all_gather", "reduce_scatter_tensor",
/// "broadcast"); empty for a group that does not use it. What went to gloo
/// is not counted: this tells which path a collective took.
std::map<std::string, int64_t> shared_memory_collectives(
    const c10::intrusive_ptr<c10d::ProcessGroup>& group);

}  // namespace fusetrain::dist
