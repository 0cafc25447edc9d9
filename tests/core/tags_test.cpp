// list_tags (core/sleep.hpp): the tags the process has named, read from the public API instead
// of probing tag_name for ids until it throws.
#include <streamsafe/core/sleep.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <string>
#include <vector>

using namespace streamsafe;

TEST_CASE("list_tags lists every tag named so far, in id order, without untagged",
          "[core][sleep]") {
  const tag_id a = tag_of("list_tags_test_a");
  const tag_id b = tag_of("list_tags_test_b");
  { tag_scope named_by_scope("list_tags_test_c"); }
  const tag_id c = tag_of("list_tags_test_c");  // named by the scope: the same id again
  const std::vector<tag_info> tags = list_tags();
  REQUIRE(tags.size() >= 3);
  for (std::size_t i = 0; i < tags.size(); ++i) {
    CHECK(tags[i].id == static_cast<tag_id>(i + 1));
    CHECK(tags[i].name == tag_name(tags[i].id));
  }
  auto listed = [&](tag_id id, const std::string& name) {
    return std::any_of(tags.begin(), tags.end(),
                       [&](const tag_info& t) { return t.id == id && t.name == name; });
  };
  CHECK(listed(a, "list_tags_test_a"));
  CHECK(listed(b, "list_tags_test_b"));
  CHECK(listed(c, "list_tags_test_c"));
  // A tag named after the call is not in that list, and is in the next one.
  const tag_id d = tag_of("list_tags_test_d");
  CHECK_FALSE(listed(d, "list_tags_test_d"));
  CHECK(list_tags().size() == std::max<std::size_t>(tags.size(), d));
}
