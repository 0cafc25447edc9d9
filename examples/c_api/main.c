/* c_api example: the streamsafe C API from a C99 program.
 *
 *   streamsafe_c_example          on the GPU (falls back to simulated devices where none is)
 *   streamsafe_c_example --sim    on two simulated devices (no GPU needed; what CI runs)
 *
 * Allocates on a stream, frees (host and stream-ordered), records a cross-stream use, routes a
 * free to the owning device while another device is current, reads statistics, empties the
 * cache, and checks that every misuse returns its error code and a last-error message. On a
 * GPU it also writes the memory with cudaMemsetAsync and reads it back. Exit status 0 when
 * every check passed, 1 otherwise. */
#include <streamsafe/streamsafe.h>

#include <cuda_runtime_api.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures = 0;

#define CHECK(cond)                                                              \
  do {                                                                           \
    if (!(cond)) {                                                               \
      fprintf(stderr, "CHECK failed at %s:%d: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                                \
    }                                                                            \
  } while (0)

/* Calls that must succeed: print the error and count a failure otherwise. */
#define OK(call)                                                              \
  do {                                                                        \
    streamsafe_status ok_status_ = (call);                                    \
    if (ok_status_ != STREAMSAFE_SUCCESS) {                                   \
      fprintf(stderr, "%s:%d: %s -> %s: %s\n", __FILE__, __LINE__, #call,     \
              streamsafe_status_string(ok_status_), streamsafe_last_error()); \
      ++failures;                                                             \
    }                                                                         \
  } while (0)

static void print_stats(int device) {
  streamsafe_stats s;
  OK(streamsafe_get_stats(device, &s));
  printf(
      "  device %d: allocated %lld B (peak %lld), reserved %lld B (peak %lld), "
      "driver allocations %llu, driver frees %llu, events %llu\n",
      device, (long long)s.allocated_bytes.current, (long long)s.allocated_bytes.peak,
      (long long)s.reserved_bytes.current, (long long)s.reserved_bytes.peak,
      (unsigned long long)s.num_device_alloc, (unsigned long long)s.num_device_free,
      (unsigned long long)s.events_recorded);
}

/* On a GPU: fill with cudaMemsetAsync on `stream`, read back, compare. */
static void check_memory(void* p, size_t n, cudaStream_t stream) {
  unsigned char* host = (unsigned char*)malloc(n);
  size_t i;
  int bad = 0;
  CHECK(host != NULL);
  if (!host) return;
  CHECK(cudaMemsetAsync(p, 0x5A, n, stream) == cudaSuccess);
  CHECK(cudaMemcpyAsync(host, p, n, cudaMemcpyDeviceToHost, stream) == cudaSuccess);
  CHECK(cudaStreamSynchronize(stream) == cudaSuccess);
  for (i = 0; i < n; ++i) bad += host[i] != 0x5A;
  CHECK(bad == 0);
  free(host);
}

int main(int argc, char** argv) {
  int simulated = argc > 1 && strcmp(argv[1], "--sim") == 0;
  int devices = 2;
  void *a = NULL, *b = NULL, *c = NULL, *d = NULL;
  void *s1 = NULL, *s2 = NULL;
  size_t released = 0;
  int owner = -2;
  streamsafe_stats st;

  OK(streamsafe_configure("release_fence:all_streams,empty_cache:wait"));
  if (!simulated) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      (void)cudaGetLastError();
      printf("no GPU here: running on simulated devices\n");
      simulated = 1;
    } else {
      devices = count;
    }
  }
  if (simulated) OK(streamsafe_use_simulated_devices(2, (size_t)4 << 30));
  printf("streamsafe C API on %s (%d device(s))\n", simulated ? "simulated devices" : "the GPU",
         devices);

  /* Streams: simulated ones, or real ones. */
  if (simulated) {
    OK(streamsafe_sim_create_stream(0, &s1));
    OK(streamsafe_sim_create_stream(0, &s2));
  } else {
    cudaStream_t r1, r2;
    CHECK(cudaStreamCreateWithFlags(&r1, cudaStreamNonBlocking) == cudaSuccess);
    CHECK(cudaStreamCreateWithFlags(&r2, cudaStreamNonBlocking) == cudaSuccess);
    s1 = r1;
    s2 = r2;
  }

  /* Allocation on a stream, host free, reuse on the same stream. */
  OK(streamsafe_malloc(&a, 1 << 20, s1));
  CHECK(a != NULL);
  if (!simulated) check_memory(a, 1 << 20, (cudaStream_t)s1);
  OK(streamsafe_free(a));
  OK(streamsafe_malloc(&b, 1 << 20, s1));
  CHECK(b == a); /* same stream: the cached block comes back at once */

  /* A cross-stream use, recorded; then a stream-ordered free on the stream of last use. */
  OK(streamsafe_record_stream(b, s2));
  OK(streamsafe_free(b));
  OK(streamsafe_malloc(&c, 8 << 20, s1));
  OK(streamsafe_free_on_stream(c, s2));

  OK(streamsafe_get_stats(0, &st));
  CHECK(st.allocated_bytes.current == 0);
  CHECK(st.reserved_bytes.current > 0);
  CHECK(st.events_recorded >= 2); /* one for the recorded use, one for the stream free */
  print_stats(0);

  /* A free routed to its device while another device is current. */
  if (devices > 1) {
    OK(streamsafe_malloc_on_device(&d, 4096, 1, NULL));
    OK(streamsafe_owner_device(d, &owner));
    CHECK(owner == 1);
    if (simulated) OK(streamsafe_sim_set_device(0));
    else CHECK(cudaSetDevice(0) == cudaSuccess);
    OK(streamsafe_free(d));
    OK(streamsafe_get_stats(1, &st));
    CHECK(st.allocated_bytes.current == 0);
    print_stats(1);
  }

  /* Misuse: each is an error code with a message, and changes nothing. */
  CHECK(streamsafe_free(b) == STREAMSAFE_ERROR_INVALID_POINTER);
  printf("  double free      -> %s\n", streamsafe_last_error());
  CHECK(strstr(streamsafe_last_error(), "devices searched") != NULL);
  {
    int x = 0;
    CHECK(streamsafe_free(&x) == STREAMSAFE_ERROR_INVALID_POINTER);
    printf("  foreign pointer  -> %s\n", streamsafe_last_error());
  }
  CHECK(streamsafe_malloc(&a, 0, NULL) == STREAMSAFE_ERROR_INVALID_SIZE);
  CHECK(a == NULL);
  printf("  0 bytes          -> %s\n", streamsafe_last_error());
  CHECK(streamsafe_configure("backend:expandable") == STREAMSAFE_ERROR_STATE);
  printf("  late configure   -> %s\n", streamsafe_last_error());
  CHECK(streamsafe_get_stats(99, &st) == STREAMSAFE_ERROR_INVALID_ARGUMENT);
  CHECK(streamsafe_malloc(NULL, 16, NULL) == STREAMSAFE_ERROR_INVALID_ARGUMENT);
  CHECK(streamsafe_malloc(&a, (size_t)1 << 50, NULL) == STREAMSAFE_ERROR_OUT_OF_MEMORY);
  printf("  1 PiB            -> %.160s...\n", streamsafe_last_error());

  /* Everything back to the driver, behind fences. */
  if (simulated) OK(streamsafe_sim_synchronize());
  else CHECK(cudaDeviceSynchronize() == cudaSuccess); /* the recorded events complete */
  OK(streamsafe_empty_cache(&released));
  OK(streamsafe_get_stats(0, &st));
  CHECK(st.reserved_bytes.current == 0);
  printf("  empty_cache released %zu bytes\n", released);
  print_stats(0);

  if (!simulated) {
    OK(streamsafe_notify_stream_destroyed(s1));
    OK(streamsafe_notify_stream_destroyed(s2));
    CHECK(cudaStreamDestroy((cudaStream_t)s1) == cudaSuccess);
    CHECK(cudaStreamDestroy((cudaStream_t)s2) == cudaSuccess);
  }
  if (failures == 0) printf("c_api example: all checks passed\n");
  else printf("c_api example: %d check(s) FAILED\n", failures);
  return failures == 0 ? 0 : 1;
}
