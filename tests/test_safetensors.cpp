// safetensors: every malformed file is a clear Error(io) naming the file and the problem; round trips
// of every dtype; zero-copy access.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "moekit/safetensors.h"
#include "test_util.h"

using namespace moekit;
namespace fs = std::filesystem;

namespace {

using moekit::test::TempDir;

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
}

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[size_t(i)] = char(uint8_t(v >> (8 * i)));
  return s;
}

// A file: 8-byte length, the header text as given, then `data_bytes` bytes of data.
std::string st_file(const std::string& header, size_t data_bytes) {
  return le64(header.size()) + header + std::string(data_bytes, '\x11');
}

// Opening `bytes` as a file must throw Error(io) whose message names the file and contains `what`.
void expect_rejected(const std::string& bytes, const std::string& what) {
  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  write_bytes(path, bytes);
  try {
    SafetensorsFile::open(path);
    ADD_FAILURE() << "accepted a malformed file; expected an error containing '" << what << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::io) << e.what();
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << "message does not name the file: " << e.what();
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << "expected '" << what << "' in: " << e.what();
  }
}

const std::string kF32x2 = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";

}  // namespace

TEST(SafetensorsBad, ValidBaseCaseOpens) {
  // The malformed cases below are small edits of this file, which is fine.
  TempDir dir;
  write_bytes(dir.file("ok.safetensors"), st_file(kF32x2, 8));
  const auto f = SafetensorsFile::open(dir.file("ok.safetensors"));
  EXPECT_EQ(f.names(), std::vector<std::string>{"a"});
}

TEST(SafetensorsBad, TruncatedBelowEightBytes) {
  expect_rejected("", "truncated");
  expect_rejected("\x05\x00\x00", "truncated");
  expect_rejected(std::string(7, '\0'), "truncated");
}

TEST(SafetensorsBad, HeaderLengthBeyondFile) {
  expect_rejected(le64(1000) + "{}", "beyond the end of the file");
  expect_rejected(le64(~uint64_t(0)) + "{}", "exceeds the 100 MB limit");
}

TEST(SafetensorsBad, HeaderOver100MB) { expect_rejected(le64(100'000'001) + "{}", "exceeds the 100 MB limit"); }

TEST(SafetensorsBad, HeaderNotJson) {
  expect_rejected(st_file("{\"a\": ", 0), "not valid JSON");
  expect_rejected(st_file("hello world", 0), "not valid JSON");
  expect_rejected(st_file("", 0), "not valid JSON");
  expect_rejected(st_file("{}garbage", 0), "not valid JSON");
  expect_rejected(st_file("{\"\xff\xfe\":1}", 0), "not valid JSON");  // not UTF-8
}

TEST(SafetensorsBad, HeaderNotAnObject) {
  expect_rejected(st_file("[1, 2]", 0), "not a JSON object");
  expect_rejected(st_file("42", 0), "not a JSON object");
  expect_rejected(st_file("\"x\"", 0), "not a JSON object");
}

TEST(SafetensorsBad, EntryNotAnObject) { expect_rejected(st_file(R"({"a":[1,2]})", 0), "'a' is not an object"); }

TEST(SafetensorsBad, EntryLacksFields) {
  expect_rejected(st_file(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", 8), "has no 'dtype'");
  expect_rejected(st_file(R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", 8), "has no 'shape'");
  expect_rejected(st_file(R"({"a":{"dtype":"F32","shape":[2]}})", 8), "has no 'data_offsets'");
}

TEST(SafetensorsBad, EntryFieldsOfWrongType) {
  expect_rejected(st_file(R"({"a":{"dtype":7,"shape":[2],"data_offsets":[0,8]}})", 8), "dtype is not a string");
  expect_rejected(st_file(R"({"a":{"dtype":"F32","shape":2,"data_offsets":[0,8]}})", 8), "shape is not an array");
  expect_rejected(st_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":8}})", 8), "data_offsets must be two");
  expect_rejected(st_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", 8), "data_offsets must be two");
  expect_rejected(st_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}})", 8),
                  "data_offsets must be two");
  expect_rejected(st_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":["0","8"]}})", 8),
                  "data_offsets must be two");
  expect_rejected(st_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}})", 8), "data_offsets must be two");
  expect_rejected(st_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0.0,8.0]}})", 8),
                  "data_offsets must be two");
}

TEST(SafetensorsBad, NonIntegerOrNegativeDimensions) {
  expect_rejected(st_file(R"({"a":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", 8), "bad dimension 2.5");
  expect_rejected(st_file(R"({"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", 8), "bad dimension 2.0");
  expect_rejected(st_file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8), "bad dimension -2");
  expect_rejected(st_file(R"({"a":{"dtype":"F32","shape":["2"],"data_offsets":[0,8]}})", 8), "bad dimension");
  expect_rejected(st_file(R"({"a":{"dtype":"F32","shape":[null],"data_offsets":[0,8]}})", 8), "bad dimension");
  // Beyond uint64: parsed as a floating-point number.
  expect_rejected(st_file(R"({"a":{"dtype":"F32","shape":[99999999999999999999999],"data_offsets":[0,8]}})", 8),
                  "bad dimension");
}

TEST(SafetensorsBad, ShapeOverflowingInt64) {
  expect_rejected(st_file(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8),
                  "overflows");
  expect_rejected(st_file(R"({"a":{"dtype":"F32","shape":[9223372036854775808],"data_offsets":[0,8]}})", 8),
                  "overflows");
  // A zero dimension must not hide a huge one (the product is 0 but the dimension cannot be an int64).
  expect_rejected(st_file(R"({"a":{"dtype":"F32","shape":[0,18446744073709551615],"data_offsets":[0,0]}})", 0),
                  "overflows");
  // Within int64 elements, but the byte count overflows uint64.
  expect_rejected(st_file(R"({"a":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,8]}})", 8),
                  "overflows the byte count");
}

TEST(SafetensorsBad, UnknownDtype) {
  expect_rejected(st_file(R"({"a":{"dtype":"F7","shape":[2],"data_offsets":[0,8]}})", 8), "unknown dtype 'F7'");
  expect_rejected(st_file(R"({"a":{"dtype":"f32","shape":[2],"data_offsets":[0,8]}})", 8), "unknown dtype 'f32'");
}

TEST(SafetensorsBad, OffsetsReversed) {
  expect_rejected(st_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8), "offsets reversed");
}

TEST(SafetensorsBad, OffsetsOutsideDataSection) {
  expect_rejected(st_file(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8),
                  "leave the data section");
  expect_rejected(st_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[18446744073709551607,18446744073709551615]}})", 8),
                  "leave the data section");
}

TEST(SafetensorsBad, DataShorterThanOffsetsNeed) {
  // A valid file cut short at every length inside its data: always a clear error.
  const std::string full = st_file(kF32x2, 8);
  for (size_t n = 8 + kF32x2.size(); n < full.size(); ++n) expect_rejected(full.substr(0, n), "file truncated?");
}

TEST(SafetensorsBad, OffsetsOverlap) {
  expect_rejected(st_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
                               "b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                          12),
                  "overlap");
  // The same bytes for two tensors.
  expect_rejected(st_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
                               "b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                          8),
                  "overlap");
  // Overlap with a tensor that is not the previous one in offset order.
  expect_rejected(st_file(R"({"a":{"dtype":"U8","shape":[16],"data_offsets":[0,16]},
                               "b":{"dtype":"U8","shape":[0],"data_offsets":[4,4]},
                               "c":{"dtype":"U8","shape":[4],"data_offsets":[8,12]}})",
                          16),
                  "overlap");
}

TEST(SafetensorsBad, GapAndTrailingSlack) {
  expect_rejected(st_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
                               "b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}})",
                          20),
                  "belong to no tensor");
  expect_rejected(st_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12), "belong to no tensor");
  expect_rejected(st_file(kF32x2, 12), "4 bytes after the last tensor");
  expect_rejected(st_file("{}", 1), "1 bytes after the last tensor");
}

TEST(SafetensorsBad, ShapeDoesNotMatchByteSize) {
  expect_rejected(st_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8), "needs 12");
  expect_rejected(st_file(R"({"a":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,8]}})", 8), "needs 12");
  expect_rejected(st_file(R"({"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}})", 2), "does not fill whole bytes");
}

TEST(SafetensorsBad, DuplicateKeys) {
  expect_rejected(st_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
                               "a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                          16),
                  "'a' more than once");
  expect_rejected(st_file(R"({"a":{"dtype":"F32","dtype":"F16","shape":[2],"data_offsets":[0,8]}})", 8),
                  "'dtype' more than once");
}

TEST(SafetensorsBad, BadMetadata) {
  expect_rejected(st_file(R"({"__metadata__":[1]})", 0), "__metadata__ is not an object");
  expect_rejected(st_file(R"({"__metadata__":{"k":1}})", 0), "metadata 'k' is not a string");
}

TEST(SafetensorsBad, NotAFile) {
  TempDir dir;
  EXPECT_THROW(SafetensorsFile::open(dir.file("missing.safetensors")), Error);
  fs::create_directories(dir.file("folder.safetensors"));
  try {
    SafetensorsFile::open(dir.file("folder.safetensors"));
    ADD_FAILURE() << "opened a directory";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not a regular file"), std::string::npos) << e.what();
  }
}

TEST(SafetensorsBad, MutatedFilesNeverCrash) {
  // Random byte edits and truncations of a valid file: each either opens (and then every tensor reads
  // inside the file) or throws Error; under the sanitizers this also checks for bad reads.
  TempDir dir;
  std::mt19937_64 rng(20240607);
  std::vector<std::pair<std::string, Tensor>> ts = {{"w", test::randn({3, 5}, DType::bf16, rng)},
                                                    {"b", test::randn({5}, DType::f32, rng)}};
  save_safetensors(dir.file("ok.safetensors"), ts, {{"format", "pt"}});
  std::ifstream in(dir.file("ok.safetensors"), std::ios::binary);
  const std::string good((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  int opened = 0, rejected = 0;
  for (int it = 0; it < 600; ++it) {
    std::string bad = good;
    if (it % 3 == 0) {
      bad.resize(size_t(rng() % good.size()));
    } else {
      for (int k = 0; k < 1 + int(rng() % 3); ++k) bad[rng() % bad.size()] = char(rng() % 256);
    }
    write_bytes(dir.file("m.safetensors"), bad);
    try {
      const auto f = SafetensorsFile::open(dir.file("m.safetensors"));
      for (const auto& e : f.entries()) {
        ASSERT_LE(e.end, f.file_size() - 8 - f.header_size());
        const Tensor t = f.get(e.name);
        ASSERT_EQ(t.nbytes(), e.nbytes());
      }
      ++opened;
    } catch (const Error& e) {
      ++rejected;
    }
  }
  EXPECT_GT(rejected, 300);
}

// ---- round trips and zero-copy access ----

TEST(SafetensorsRoundTrip, EveryDtype) {
  TempDir dir;
  std::mt19937_64 rng(7);
  const std::vector<std::pair<DType, Shape>> cases = {
      {DType::f32, {3, 4}},    {DType::bf16, {2, 3, 5}}, {DType::f16, {7}},        {DType::f64, {2, 2}},
      {DType::f8e4m3, {4, 8}}, {DType::ue8m0, {3, 1}},   {DType::f4e2m1, {2, 6}}, {DType::i32, {5}},
      {DType::i64, {1, 3}},    {DType::u8, {9}},         {DType::i8, {2, 2, 2}},   {DType::boolean, {6}},
      {DType::f32, {}},        {DType::bf16, {0, 4}},
  };
  std::vector<std::pair<std::string, Tensor>> ts;
  for (size_t i = 0; i < cases.size(); ++i) {
    Tensor t = Tensor::empty(cases[i].second, cases[i].first);
    auto* p = static_cast<uint8_t*>(t.data());
    for (size_t b = 0; b < t.nbytes(); ++b) p[b] = uint8_t(rng());
    if (cases[i].first == DType::boolean)
      for (size_t b = 0; b < t.nbytes(); ++b) p[b] &= 1;
    ts.push_back({"t" + std::to_string(i) + "." + dtype_name(cases[i].first), t});
  }
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"note", "round trip"}};
  const std::string path = dir.file("all.safetensors");
  save_safetensors(path, ts, meta);
  EXPECT_FALSE(fs::exists(path + ".partial"));
  const auto f = SafetensorsFile::open(path);
  EXPECT_EQ(f.metadata(), meta);
  EXPECT_EQ(f.header_size() % 8, 0u);
  ASSERT_EQ(f.entries().size(), ts.size());
  for (const auto& [name, t] : ts) {
    ASSERT_TRUE(f.contains(name)) << name;
    const Tensor r = f.get(name);
    EXPECT_EQ(r.dtype(), t.dtype()) << name;
    EXPECT_EQ(r.shape(), t.shape()) << name;
    ASSERT_EQ(r.nbytes(), t.nbytes()) << name;
    EXPECT_EQ(std::memcmp(r.data(), t.data(), t.nbytes()), 0) << name;
    EXPECT_EQ(parse_safetensors_dtype(safetensors_dtype_name(t.dtype())), t.dtype());
  }
  EXPECT_EQ(f.entries().front().begin, 0u);  // offset order, contiguous
  EXPECT_EQ(f.entries().back().end, f.file_size() - 8 - f.header_size());
}

TEST(SafetensorsRoundTrip, ZeroCopyAndPrivateMapping) {
  TempDir dir;
  std::mt19937_64 rng(11);
  const Tensor w = test::randn({16, 8}, DType::f32, rng);
  const std::string path = dir.file("w.safetensors");
  save_safetensors(path, {{"w", w}});
  Tensor a, b;
  {
    const auto f = SafetensorsFile::open(path);
    a = f.get("w");
    b = f.get("w");
    EXPECT_EQ(a.data(), b.data()) << "get() copied the data";
    const auto* base = reinterpret_cast<const uint8_t*>(a.data());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(base) % 4096, (8 + f.header_size()) % 4096) << "not inside the mapping";
  }
  // The tensors keep the mapping alive after the file object is gone.
  EXPECT_EQ(std::memcmp(a.data(), w.data(), w.nbytes()), 0);
  // Writing through a tensor changes neither the file nor a later mapping.
  a.ptr<float>()[0] = 12345.0f;
  EXPECT_EQ(b.ptr<float>()[0], 12345.0f);
  const auto again = SafetensorsFile::open(path);
  EXPECT_EQ(again.get("w").ptr<float>()[0], w.ptr<float>()[0]);
}

TEST(SafetensorsRoundTrip, MisalignedDataIsCopiedAligned) {
  // A header whose length is not a multiple of 8 (other writers do this) leaves f32 data unaligned.
  TempDir dir;
  const std::string header = R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}})";
  ASSERT_NE((8 + header.size()) % 4, 0u);
  const float vals[3] = {1.5f, -2.25f, 3.0f};
  std::string data(12, '\0');
  std::memcpy(data.data(), vals, 12);
  write_bytes(dir.file("x.safetensors"), le64(header.size()) + header + data);
  const auto f = SafetensorsFile::open(dir.file("x.safetensors"));
  const Tensor x = f.get("x");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(x.data()) % alignof(float), 0u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(x.ptr<float>()[i], vals[i]);
}

TEST(SafetensorsRoundTrip, MissingTensorNamesCloseOnes) {
  TempDir dir;
  std::mt19937_64 rng(3);
  save_safetensors(dir.file("m.safetensors"), {{"model.layers.0.mlp.gate.weight", test::randn({2, 2}, DType::f32, rng)},
                                               {"model.norm.weight", test::randn({2}, DType::f32, rng)}});
  const auto f = SafetensorsFile::open(dir.file("m.safetensors"));
  try {
    f.get("model.layers.0.mlp.gate.weigth");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::not_found);
    EXPECT_NE(std::string(e.what()).find("'model.layers.0.mlp.gate.weight'"), std::string::npos) << e.what();
  }
}

TEST(SafetensorsRoundTrip, SaveRejectsBadInput) {
  TempDir dir;
  std::mt19937_64 rng(5);
  const Tensor t = test::randn({2}, DType::f32, rng);
  EXPECT_THROW(save_safetensors(dir.file("a.safetensors"), {{"x", t}, {"x", t}}), Error);
  EXPECT_THROW(save_safetensors(dir.file("a.safetensors"), {{"__metadata__", t}}), Error);
  EXPECT_THROW(save_safetensors(dir.file("a.safetensors"), {{"odd", Tensor::empty({3}, DType::f4e2m1)}}), Error);
  EXPECT_THROW(save_safetensors(dir.file("no/such/dir/a.safetensors"), {{"x", t}}), Error);
  EXPECT_FALSE(fs::exists(dir.file("a.safetensors")));
}
