// A C interface to Gloo (the collective library PyTorch uses for CPU tensors) over its TCP transport,
// for harpe's `comms::gloo`: one context per group, the collectives the training loop needs, every
// C++ exception turned into an error code and a message.
//
// The rendezvous store is harpe's: `hg_store` callbacks reach the Rust side, which talks to a
// TCPStore (torchrun's agent store, or the one rank 0 serves under harpe's own launcher and Slurm).
// Collectives take raw byte buffers and an element type; the reductions are sums in the element type
// (f32 or f64). Gloo has no reduce-scatter over uneven slices: `hg_reduce` to each root in turn is how
// the Rust side builds it (as NCCL's reduce-scatter-v is one ncclReduce per root).
// Not thread-safe per context: the Rust side issues every collective of a context from one thread.
#include <gloo/allgatherv.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/math.h>
#include <gloo/reduce.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

extern "C" {
// The store, implemented in Rust. Each returns 0 on success; on failure it leaves its message for
// `err` to read. `get` blocks until the key is set (or its deadline passes) and hands out a pointer
// valid until the next call on the same store.
struct hg_store {
  void* ud;
  int (*set)(void* ud, const char* key, const char* data, size_t len);
  int (*get)(void* ud, const char* key, const char** data, size_t* len);
  const char* (*err)(void* ud);
};

struct hg_ctx {
  std::shared_ptr<gloo::rendezvous::Context> ctx;
  std::chrono::milliseconds timeout;
};
}

namespace {

class CallbackStore : public gloo::rendezvous::Store {
 public:
  explicit CallbackStore(const hg_store* s) : s_(s) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    if (s_->set(s_->ud, key.c_str(), data.data(), data.size()) != 0) {
      throw std::runtime_error(std::string("store set ") + key + ": " + s_->err(s_->ud));
    }
  }
  std::vector<char> get(const std::string& key) override {
    const char* p = nullptr;
    size_t n = 0;
    if (s_->get(s_->ud, key.c_str(), &p, &n) != 0) {
      throw std::runtime_error(std::string("store get ") + key + ": " + s_->err(s_->ud));
    }
    return std::vector<char>(p, p + n);
  }
  void wait(const std::vector<std::string>& keys) override {
    for (const auto& k : keys) get(k);
  }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds&) override {
    wait(keys);  // the Rust side's get carries the deadline
  }

 private:
  const hg_store* s_;
};

void put_err(char* err, size_t errlen, const std::string& msg) {
  if (err == nullptr || errlen == 0) return;
  std::strncpy(err, msg.c_str(), errlen - 1);
  err[errlen - 1] = '\0';
}

// Run `f`, turning any exception into -1 and its message.
template <typename F>
int guarded(char* err, size_t errlen, F f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    put_err(err, errlen, e.what());
  } catch (...) {
    put_err(err, errlen, "unknown C++ exception");
  }
  return -1;
}

using ReduceFn = void (*)(void*, const void*, const void*, size_t);

ReduceFn sum_fn(int dtype) {
  switch (dtype) {
    case 0:
      return static_cast<ReduceFn>(&gloo::sum<float>);
    case 1:
      return static_cast<ReduceFn>(&gloo::sum<double>);
    default:
      throw std::runtime_error("internal: a sum of an element type other than f32 or f64");
  }
}

size_t elem_size(int dtype) { return dtype == 1 ? 8 : 4; }

}  // namespace

extern "C" {

// Join a group of `size` ranks as `rank`: every pair connected over TCP, from `hostname` (the address
// this rank is reached at), the peers' addresses exchanged through `store` under `prefix`.
hg_ctx* hg_connect(int rank, int size, const char* hostname, const char* prefix, const hg_store* store,
                   int64_t timeout_ms, char* err, size_t errlen) {
  hg_ctx* out = nullptr;
  guarded(err, errlen, [&] {
    gloo::transport::tcp::attr attr;
    attr.hostname = hostname;
    auto dev = gloo::transport::tcp::CreateDevice(attr);
    auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
    auto timeout = std::chrono::milliseconds(timeout_ms);
    ctx->setTimeout(timeout);
    CallbackStore cb(store);
    gloo::rendezvous::PrefixStore prefixed(prefix, cb);
    ctx->connectFullMesh(prefixed, dev);
    out = new hg_ctx{ctx, timeout};
  });
  return out;
}

void hg_free(hg_ctx* c) { delete c; }

// Sum `n` elements of `buf` over the group, in place (dtype 0 = f32, 1 = f64).
int hg_allreduce(hg_ctx* c, int dtype, void* buf, size_t n, uint32_t tag, char* err, size_t errlen) {
  return guarded(err, errlen, [&] {
    gloo::AllreduceOptions o(c->ctx);
    if (dtype == 1) {
      o.setOutput(static_cast<double*>(buf), n);
    } else {
      o.setOutput(static_cast<float*>(buf), n);
    }
    o.setReduceFunction(sum_fn(dtype));
    o.setTag(tag);
    o.setTimeout(c->timeout);
    gloo::allreduce(o);
  });
}

// Sum `n` elements of `in` over the group into `out` at `root` (`out` is ignored elsewhere).
int hg_reduce(hg_ctx* c, int dtype, const void* in, void* out, size_t n, int root, uint32_t tag, char* err,
              size_t errlen) {
  return guarded(err, errlen, [&] {
    gloo::ReduceOptions o(c->ctx);
    // Gloo reduces in the output buffer: every rank starts from its own input there
    std::vector<char> scratch;
    void* dst = out;
    if (c->ctx->rank != root) {
      scratch.resize(n * elem_size(dtype));
      dst = scratch.data();
    }
    std::memcpy(dst, in, n * elem_size(dtype));
    if (dtype == 1) {
      o.setOutput(static_cast<double*>(dst), n);
    } else {
      o.setOutput(static_cast<float*>(dst), n);
    }
    o.setRoot(root);
    o.setReduceFunction(sum_fn(dtype));
    o.setTag(tag);
    o.setTimeout(c->timeout);
    gloo::reduce(o);
  });
}

// Concatenate every rank's `in` (bytes[rank] bytes) into `out`, in rank order.
int hg_allgatherv(hg_ctx* c, const void* in, void* out, const size_t* bytes, uint32_t tag, char* err,
                  size_t errlen) {
  return guarded(err, errlen, [&] {
    gloo::AllgathervOptions o(c->ctx);
    std::vector<size_t> counts(bytes, bytes + c->ctx->size);
    o.setInput(const_cast<char*>(static_cast<const char*>(in)), counts[c->ctx->rank]);
    o.setOutput(static_cast<char*>(out), counts);
    o.setTag(tag);
    o.setTimeout(c->timeout);
    gloo::allgatherv(o);
  });
}

// Equal-chunk all-to-all of `bytes` bytes: chunk j of `in` goes to rank j; chunk i of `out` came from rank i.
int hg_alltoall(hg_ctx* c, const void* in, void* out, size_t bytes, uint32_t tag, char* err, size_t errlen) {
  return guarded(err, errlen, [&] {
    gloo::AlltoallOptions o(c->ctx);
    o.setInput(const_cast<char*>(static_cast<const char*>(in)), bytes);
    o.setOutput(static_cast<char*>(out), bytes);
    o.setTag(tag);
    o.setTimeout(c->timeout);
    gloo::alltoall(o);
  });
}

// `bytes` bytes of `buf` at `root` copied into `buf` everywhere.
int hg_broadcast(hg_ctx* c, void* buf, size_t bytes, int root, uint32_t tag, char* err, size_t errlen) {
  return guarded(err, errlen, [&] {
    gloo::BroadcastOptions o(c->ctx);
    o.setOutput(static_cast<char*>(buf), bytes);
    o.setRoot(root);
    o.setTag(tag);
    o.setTimeout(c->timeout);
    gloo::broadcast(o);
  });
}

int hg_barrier(hg_ctx* c, uint32_t tag, char* err, size_t errlen) {
  return guarded(err, errlen, [&] {
    gloo::BarrierOptions o(c->ctx);
    o.setTag(tag);
    o.setTimeout(c->timeout);
    gloo::barrier(o);
  });
}

}  // extern "C"
