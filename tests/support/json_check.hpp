// Test support: a strict JSON syntax checker (RFC 8259 grammar, no extensions), so tests can
// assert that what the library writes parses, without a JSON library. Returns an empty string
// when the text is one valid JSON value, else what is wrong and at which offset.
#pragma once

#include <cctype>
#include <cstddef>
#include <string>
#include <string_view>

namespace streamsafe::test {

class json_checker {
 public:
  explicit json_checker(std::string_view text) : s_(text) {}

  std::string check() {
    skip_ws();
    if (!value(0)) return error_;
    skip_ws();
    if (pos_ != s_.size()) return fail("trailing characters");
    return {};
  }

 private:
  std::string fail(const std::string& what) {
    if (error_.empty()) error_ = what + " at offset " + std::to_string(pos_);
    return error_;
  }
  bool bad(const std::string& what) {
    fail(what);
    return false;
  }
  void skip_ws() {
    while (pos_ < s_.size() &&
           (s_[pos_] == ' ' || s_[pos_] == '\n' || s_[pos_] == '\r' || s_[pos_] == '\t'))
      ++pos_;
  }
  bool literal(std::string_view word) {
    if (s_.substr(pos_, word.size()) != word) return bad("bad literal");
    pos_ += word.size();
    return true;
  }
  bool digits() {
    const std::size_t start = pos_;
    while (pos_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[pos_]))) ++pos_;
    return pos_ > start || bad("digit expected");
  }
  bool number() {
    if (s_[pos_] == '-') ++pos_;
    if (pos_ < s_.size() && s_[pos_] == '0') {
      ++pos_;
    } else if (!digits()) {
      return false;
    }
    if (pos_ < s_.size() && s_[pos_] == '.') {
      ++pos_;
      if (!digits()) return false;
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      ++pos_;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      if (!digits()) return false;
    }
    return true;
  }
  bool string() {
    ++pos_;  // opening quote
    while (pos_ < s_.size()) {
      const unsigned char c = static_cast<unsigned char>(s_[pos_++]);
      if (c == '"') return true;
      if (c < 0x20) return bad("control character in string");
      if (c == '\\') {
        if (pos_ >= s_.size()) break;
        const char e = s_[pos_++];
        if (e == 'u') {
          for (int i = 0; i < 4; ++i, ++pos_) {
            if (pos_ >= s_.size() || !std::isxdigit(static_cast<unsigned char>(s_[pos_])))
              return bad("bad \\u escape");
          }
        } else if (std::string_view("\"\\/bfnrt").find(e) == std::string_view::npos) {
          return bad("bad escape");
        }
      }
    }
    return bad("unterminated string");
  }
  bool value(int depth) {
    if (depth > 64) return bad("nesting too deep");
    if (pos_ >= s_.size()) return bad("value expected");
    const char c = s_[pos_];
    if (c == '{') return container(depth, '}', true);
    if (c == '[') return container(depth, ']', false);
    if (c == '"') return string();
    if (c == 't') return literal("true");
    if (c == 'f') return literal("false");
    if (c == 'n') return literal("null");
    if (c == '-' || std::isdigit(static_cast<unsigned char>(c))) return number();
    return bad(std::string("unexpected character '") + c + "'");
  }
  bool container(int depth, char close, bool object) {
    ++pos_;
    skip_ws();
    if (pos_ < s_.size() && s_[pos_] == close) {
      ++pos_;
      return true;
    }
    while (true) {
      skip_ws();
      if (object) {
        if (pos_ >= s_.size() || s_[pos_] != '"') return bad("key expected");
        if (!string()) return false;
        skip_ws();
        if (pos_ >= s_.size() || s_[pos_] != ':') return bad("':' expected");
        ++pos_;
        skip_ws();
      }
      if (!value(depth + 1)) return false;
      skip_ws();
      if (pos_ >= s_.size()) return bad("unterminated container");
      if (s_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (s_[pos_] == close) {
        ++pos_;
        return true;
      }
      return bad("',' or closing bracket expected");
    }
  }

  std::string_view s_;
  std::size_t pos_ = 0;
  std::string error_;
};

inline std::string json_error(std::string_view text) { return json_checker(text).check(); }

}  // namespace streamsafe::test
