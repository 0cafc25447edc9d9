/* A C consumer of the installed streamsafe package: the C API (streamsafe::c in CMake, or
 * pkg-config --cflags --libs streamsafe) over simulated devices. Exit status 0 when it works. */
#include <streamsafe/streamsafe.h>

#include <stdio.h>

int main(void) {
  void* p = NULL;
  streamsafe_stats stats;
  if (streamsafe_use_simulated_devices(1, (size_t)1 << 30) != STREAMSAFE_SUCCESS ||
      streamsafe_malloc(&p, 4096, NULL) != STREAMSAFE_SUCCESS ||
      streamsafe_free(p) != STREAMSAFE_SUCCESS ||
      streamsafe_get_stats(0, &stats) != STREAMSAFE_SUCCESS || stats.allocated_bytes.peak != 4096) {
    fprintf(stderr, "consumer (C): FAILED: %s\n", streamsafe_last_error());
    return 1;
  }
  printf("consumer (C): ok (reserved %lld bytes)\n", (long long)stats.reserved_bytes.current);
  return 0;
}
