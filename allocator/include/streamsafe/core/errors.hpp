// streamsafe: the exceptions the library throws.
//
//  out_of_memory     (std::bad_alloc)     a request the device cannot satisfy, after a safe
//                                         release of cached memory and a retry.
//  invalid_pointer   (std::logic_error)   free / record_stream of a pointer the allocator did
//                                         not hand out, freed twice, interior, or owned by
//                                         another device.
//  invalid_size      (std::invalid_argument) a request of 0 bytes.
//  config_error      (std::invalid_argument) a bad STREAMSAFE_ALLOC_CONF key or value.
//  backend_error     (std::runtime_error)  a driver call failed for a reason other than
//                                         running out of memory (also: a backend without
//                                         the call, such as IPC on a backend that lacks it).
//  tag_paused        (std::logic_error)   an allocation under a tag that is paused (or being
//                                         paused or resumed): resume it first.
//  ipc_error         (std::logic_error)   an interprocess handle or release message that is
//                                         malformed, unknown, released twice, imported twice,
//                                         or used during a CUDA graph capture (core/ipc.hpp).
// Every error leaves the allocator's state and statistics as they were before the call.
#pragma once

#include <new>
#include <stdexcept>
#include <string>

namespace streamsafe {

class out_of_memory : public std::bad_alloc {
 public:
  explicit out_of_memory(std::string message) : message_(std::move(message)) {}
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  std::string message_;
};

class invalid_pointer : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

class invalid_size : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

class config_error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

class backend_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class tag_paused : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

class ipc_error : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

}  // namespace streamsafe
