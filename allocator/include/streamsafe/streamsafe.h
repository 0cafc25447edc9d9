/* streamsafe: the C API (C99; also usable from C++).
 *
 * A stream-safe caching CUDA device allocator behind plain C calls, in the shared library
 * libstreamsafe_c.so (CMake target streamsafe::c, pkg-config package "streamsafe"). CUDA
 * streams are passed as void* (a cudaStream_t value; NULL is the legacy default stream), so
 * this header includes no CUDA header.
 *
 * Stream-ordering contract:
 *  - streamsafe_malloc(&p, n, s): p may be used on stream s at once, on the calling thread's
 *    current device.
 *  - streamsafe_free(p): host free; the last use of p is on its allocation stream or on streams
 *    given to streamsafe_record_stream. It may be called with any device current.
 *  - streamsafe_free_on_stream(p, s): stream-ordered free; the last use of p is on stream s.
 *  - Cached memory goes back to the driver only after every stream that may still use it has
 *    passed a fence (streamsafe_empty_cache, out-of-memory retries).
 *  - cudaStreamPerThread ((void*)2) as the allocation stream: the block is served from the
 *    legacy stream's pool and freed on the per-thread stream of the thread that frees it.
 *
 * Errors: every call returns a streamsafe_status. On failure the calling thread's last-error
 * message (streamsafe_last_error) says what happened; the allocator's state and statistics are
 * unchanged. A successful call leaves the message as it was.
 *
 * Thread safety: every function may be called from any thread, except streamsafe_configure and
 * streamsafe_use_simulated_devices, which must run before the first allocation, on one thread.
 *
 * Process-wide state: the library keeps one allocator per process (per copy of the library),
 * configured from STREAMSAFE_ALLOC_CONF or streamsafe_configure. It is never destroyed: cached
 * memory goes back to the driver when the process exits. It is not the one that
 * streamsafe::cuda::allocator::instance() returns to C++ code linked against the static
 * libraries: do not free through one what the other allocated.
 */
#ifndef STREAMSAFE_STREAMSAFE_H
#define STREAMSAFE_STREAMSAFE_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define STREAMSAFE_C_API
#else
#define STREAMSAFE_C_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define STREAMSAFE_VERSION_MAJOR 0
#define STREAMSAFE_VERSION_MINOR 1
#define STREAMSAFE_VERSION_PATCH 0

typedef enum streamsafe_status {
  STREAMSAFE_SUCCESS = 0,
  STREAMSAFE_ERROR_OUT_OF_MEMORY = 1,    /* the device (or its configured limit) cannot serve it */
  STREAMSAFE_ERROR_INVALID_POINTER = 2,  /* not allocated here, freed twice, or interior */
  STREAMSAFE_ERROR_INVALID_SIZE = 3,     /* a request of 0 bytes */
  STREAMSAFE_ERROR_INVALID_ARGUMENT = 4, /* a NULL output pointer, a device that does not exist */
  STREAMSAFE_ERROR_CONFIG = 5,           /* a bad configuration key or value */
  STREAMSAFE_ERROR_BACKEND = 6,          /* a CUDA call failed (also: no GPU present) */
  STREAMSAFE_ERROR_STATE = 7,            /* configure after the first allocation */
  STREAMSAFE_ERROR_UNKNOWN = 8,
  STREAMSAFE_ERROR_TAG_PAUSED = 9, /* an allocation under a paused tag; a pause or resume
                                      refused in the current state (capture, callback) */
  STREAMSAFE_ERROR_IPC = 10 /* an IPC handle or release malformed, unknown, used twice, or during
                              a CUDA graph capture */
} streamsafe_status;

/* One statistic: current value, peak since start (or the last reset), totals added/removed. */
typedef struct streamsafe_stat {
  int64_t current;
  int64_t peak;
  int64_t allocated;
  int64_t freed;
} streamsafe_stat;

/* The statistics of one device, named as PyTorch names them. *_bytes in bytes. */
typedef struct streamsafe_stats {
  streamsafe_stat allocated_bytes;      /* handed out, not yet freed by the host */
  streamsafe_stat reserved_bytes;       /* held from the driver */
  streamsafe_stat active_bytes;         /* allocated + freed with cross-stream uses pending */
  streamsafe_stat inactive_split_bytes; /* free bytes in segments that also hold active blocks */
  streamsafe_stat requested_bytes;      /* bytes asked for, before rounding */
  streamsafe_stat allocation;           /* count of allocated blocks */
  streamsafe_stat segment;              /* count of segments */
  streamsafe_stat active;               /* count of active blocks */
  uint64_t num_alloc_retries;
  uint64_t num_ooms;
  uint64_t num_device_alloc; /* segment allocations / chunk maps from the driver */
  uint64_t num_device_free;  /* segment frees / chunk unmaps to the driver */
  uint64_t num_sync_all_streams;
  uint64_t events_recorded;
  uint64_t stream_waits;
  uint64_t fence_waits;
  uint64_t fence_wait_ns;
  uint64_t releases_deferred;
  uint64_t bytes_released;
  uint64_t segments_moved;
  uint64_t pending_release_bytes; /* waiting in the deferred-release queue now */
} streamsafe_stats;

/* Allocates `bytes` (> 0) on the calling thread's current device, usable on `stream` at once;
 * aligned to 512 bytes. *ptr is NULL on failure. */
STREAMSAFE_C_API streamsafe_status streamsafe_malloc(void** ptr, size_t bytes, void* stream);
/* The same on `device`; `stream` must belong to that device. */
STREAMSAFE_C_API streamsafe_status streamsafe_malloc_on_device(void** ptr, size_t bytes, int device,
                                                               void* stream);
/* Host free (see the contract above). streamsafe_free(NULL) does nothing and succeeds. */
STREAMSAFE_C_API streamsafe_status streamsafe_free(void* ptr);
/* Stream-ordered free: the last use of ptr is on `stream`. NULL ptr: nothing, success. */
STREAMSAFE_C_API streamsafe_status streamsafe_free_on_stream(void* ptr, void* stream);
/* Records a use of ptr on `stream` (before its free). */
STREAMSAFE_C_API streamsafe_status streamsafe_record_stream(void* ptr, void* stream);
/* Tells the allocator that `stream` is about to be destroyed (call before cudaStreamDestroy). */
STREAMSAFE_C_API streamsafe_status streamsafe_notify_stream_destroyed(void* stream);
/* CUDA graph capture (case K11). Call streamsafe_notify_capture_begin just before
 * cudaStreamBeginCapture(stream) and streamsafe_notify_capture_end just after
 * cudaStreamEndCapture: in between the stream's device makes no releasing, synchronising or
 * event-query call, the stream is served from the graph's private pool (or new memory, else
 * STREAMSAFE_ERROR_OUT_OF_MEMORY), and *graph (may be NULL) receives the graph's id on that
 * device. streamsafe_notify_graph_released: the graph will not be launched again; its memory
 * becomes releasable. STREAMSAFE_ERROR_INVALID_ARGUMENT: stream 0, a stream already (or not)
 * capturing, an unknown graph. */
STREAMSAFE_C_API streamsafe_status streamsafe_notify_capture_begin(void* stream, uint64_t* graph);
STREAMSAFE_C_API streamsafe_status streamsafe_notify_capture_end(void* stream, uint64_t* graph);
STREAMSAFE_C_API streamsafe_status streamsafe_notify_graph_released(uint64_t graph, int device);

/* Releases cached memory of every device behind release fences; *released_bytes (may be NULL)
 * receives the bytes given back. Blocks on exactly the fence events (empty_cache:wait, the
 * default) or defers what is not yet safe (empty_cache:defer). */
STREAMSAFE_C_API streamsafe_status streamsafe_empty_cache(size_t* released_bytes);
/* Finishes deferred releases whose fences have completed; never blocks. */
STREAMSAFE_C_API streamsafe_status streamsafe_reclaim(size_t* released_bytes);

/* ---- tags and sleep/wake (docs/sleep.md) ------------------------------------------------------
 * streamsafe_tag_push(name): until the matching streamsafe_tag_pop, allocations on the calling
 * thread belong to the tag (1 to 64 printable characters; STREAMSAFE_ERROR_CONFIG otherwise).
 * Pushes nest; pop without a push is STREAMSAFE_ERROR_STATE.
 * streamsafe_pause(tag, device, mode, wait, status): the tag's memory on `device` goes back to
 * the driver behind its release fence, its addresses stay reserved (expandable backend only:
 * STREAMSAFE_ERROR_CONFIG otherwise). wait != 0: returns when all of it is back; wait == 0:
 * never blocks (the rest follows as fences complete). Allocations under the tag fail with
 * STREAMSAFE_ERROR_TAG_PAUSED until streamsafe_resume, which maps memory at the same addresses,
 * restores offloaded contents, and orders the tag's streams (and `stream`, which may be NULL)
 * after the restore. status (may be NULL) receives the tag's phase and bytes. */
typedef enum streamsafe_pause_mode {
  STREAMSAFE_PAUSE_DISCARD = 0, /* contents lost (a KV cache) */
  STREAMSAFE_PAUSE_OFFLOAD = 1  /* contents copied to pinned host memory and back */
} streamsafe_pause_mode;

typedef struct streamsafe_pause_status {
  int phase;                   /* 0 active, 1 pausing (some chunks behind their fence), 2 paused */
  size_t released_bytes;       /* given back to the driver */
  size_t pending_bytes;        /* still mapped, waiting for a fence or an offload copy */
  size_t offloaded_host_bytes; /* pinned host bytes holding offloaded contents */
  size_t allocated_bytes;      /* the tag's live blocks */
  size_t reserved_bytes;       /* the tag's mapped bytes now */
} streamsafe_pause_status;

STREAMSAFE_C_API streamsafe_status streamsafe_tag_push(const char* tag);
STREAMSAFE_C_API streamsafe_status streamsafe_tag_pop(void);
STREAMSAFE_C_API streamsafe_status streamsafe_pause(const char* tag, int device,
                                                    streamsafe_pause_mode mode, int wait,
                                                    streamsafe_pause_status* status);
STREAMSAFE_C_API streamsafe_status streamsafe_resume(const char* tag, int device, void* stream,
                                                     streamsafe_pause_status* status);
STREAMSAFE_C_API streamsafe_status streamsafe_tag_status(const char* tag, int device,
                                                         streamsafe_pause_status* status);
/* Every tag named so far in the process (by streamsafe_tag_push or any front end), in the order
 * they were first named: *count receives how many there are, and names[0 .. min(count,
 * capacity)) their names. The strings stay valid until the calling thread's next
 * streamsafe_list_tags. names may be NULL when capacity is 0 (ask for the count first);
 * STREAMSAFE_ERROR_INVALID_ARGUMENT when count is NULL, or names is NULL with a capacity. */
STREAMSAFE_C_API streamsafe_status streamsafe_list_tags(const char** names, size_t capacity,
                                                        size_t* count);
/* The tag's cached free memory on every device back to the driver (as streamsafe_empty_cache). */
STREAMSAFE_C_API streamsafe_status streamsafe_empty_cache_tag(const char* tag,
                                                              size_t* released_bytes);
/* Cached free memory back, largest blocks first, until at most bytes_to_keep stay free on each
 * device. */
STREAMSAFE_C_API streamsafe_status streamsafe_trim(size_t bytes_to_keep, size_t* released_bytes);

/* Statistics of `device` (all zero before its first allocation). */
STREAMSAFE_C_API streamsafe_status streamsafe_get_stats(int device, streamsafe_stats* stats);
STREAMSAFE_C_API streamsafe_status streamsafe_reset_peak_stats(int device);
/* The device whose allocator handed out ptr, or -1 in *device when none did. */
STREAMSAFE_C_API streamsafe_status streamsafe_owner_device(const void* ptr, int* device);

/* ---- interprocess sharing (IPC) ---------------------------------------------------------------
 * Producer: streamsafe_export_block(p, &h, &n) returns in *h (n bytes, freed with
 * streamsafe_ipc_free) a handle that another process opens with streamsafe_import_block. Ship
 * the bytes over any channel; for the expandable backend the handle names file descriptors:
 * send it with streamsafe_send_ipc_handle over a Unix-domain socket (SCM_RIGHTS), or ship the
 * bytes alone and the importer fetches them with pidfd_getfd (needs ptrace rights over the
 * producer). A free of an exported block is held (it stays allocated, neither reused nor released
 * by empty_cache) until every export of it has ended: the consumer called
 * streamsafe_release_import, its message reached streamsafe_notify_import_released, and the
 * consumer's event recorded then has completed (polled, never waited on by malloc or free).
 * streamsafe_revoke_exports ends the exports of p whose consumer died without releasing.
 * Consumer: streamsafe_import_block maps the block on `device` (-1: the current device) at *ptr
 * (*size_bytes may be NULL); streamsafe_release_import(ptr, stream, release) records the event on
 * `stream` after the consumer's last use there and writes STREAMSAFE_IPC_RELEASE_BYTES bytes to
 * `release` for the producer; the mapping closes once that event has completed.
 * Errors: STREAMSAFE_ERROR_INVALID_POINTER (export of a freed or unknown pointer),
 * STREAMSAFE_ERROR_IPC (malformed or unknown handle or release, imported or released twice,
 * during a capture), STREAMSAFE_ERROR_BACKEND (the driver refused, e.g. the producer is gone). */
#define STREAMSAFE_IPC_RELEASE_BYTES 32
STREAMSAFE_C_API streamsafe_status streamsafe_export_block(void* ptr, void** handle,
                                                           size_t* handle_bytes);
STREAMSAFE_C_API void streamsafe_ipc_free(void* buffer);
STREAMSAFE_C_API streamsafe_status streamsafe_notify_import_released(const void* release,
                                                                     size_t release_bytes);
STREAMSAFE_C_API streamsafe_status streamsafe_revoke_exports(void* ptr, size_t* revoked);
STREAMSAFE_C_API streamsafe_status streamsafe_import_block(const void* handle, size_t handle_bytes,
                                                           int device, void** ptr,
                                                           size_t* size_bytes);
STREAMSAFE_C_API streamsafe_status streamsafe_release_import(void* ptr, void* stream,
                                                             void* release);
/* One handle over a connected Unix-domain socket, descriptors as SCM_RIGHTS; the received
 * handle (*handle, freed with streamsafe_ipc_free) names the receiver's own descriptors. */
STREAMSAFE_C_API streamsafe_status streamsafe_send_ipc_handle(int socket_fd, const void* handle,
                                                              size_t handle_bytes);
STREAMSAFE_C_API streamsafe_status streamsafe_receive_ipc_handle(int socket_fd, void** handle,
                                                                 size_t* handle_bytes);

/* Sets the configuration ("key:value,key:value", the keys of STREAMSAFE_ALLOC_CONF, which it
 * replaces). Only before the first allocation: afterwards STREAMSAFE_ERROR_STATE. */
STREAMSAFE_C_API streamsafe_status streamsafe_configure(const char* conf);

/* The calling thread's message for its last failed call; "" when none. Valid until the
 * thread's next failing call. */
STREAMSAFE_C_API const char* streamsafe_last_error(void);
/* "STREAMSAFE_SUCCESS", "STREAMSAFE_ERROR_OUT_OF_MEMORY", ... */
STREAMSAFE_C_API const char* streamsafe_status_string(streamsafe_status status);

/* ---- testing without a GPU -------------------------------------------------------------------
 * Replaces the process allocator by one over `device_count` simulated devices of
 * `bytes_per_device` each (CPU only: the memory is not real and must not be dereferenced), so
 * that programs and tests can exercise this API where no GPU is present. Before the first
 * allocation only (else STREAMSAFE_ERROR_STATE); keeps the configuration set so far. */
STREAMSAFE_C_API streamsafe_status streamsafe_use_simulated_devices(int device_count,
                                                                    size_t bytes_per_device);
/* Simulated mode: the calling thread's current device (default 0). */
STREAMSAFE_C_API streamsafe_status streamsafe_sim_set_device(int device);
/* Simulated mode: a new stream of `device`. */
STREAMSAFE_C_API streamsafe_status streamsafe_sim_create_stream(int device, void** stream);
/* Simulated mode: runs every simulated device's queued work to completion (a stand-in for
 * cudaDeviceSynchronize). */
STREAMSAFE_C_API streamsafe_status streamsafe_sim_synchronize(void);
/* 1 when the process allocator runs over simulated devices, else 0. */
STREAMSAFE_C_API int streamsafe_is_simulated(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* STREAMSAFE_STREAMSAFE_H */
