// Core types: dtype conversions, tensors, errors, the registry.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <utility>
#include <vector>

#include "base/env.h"
#include "test_util.h"

using namespace moekit;

TEST(DType, Bf16RoundTripAndRounding) {
  for (float v : {0.0f, 1.0f, -2.5f, 3.14159f, 1e-20f, 65504.0f}) {
    EXPECT_NEAR(bf16_to_f32(f32_to_bf16(v)), v, std::fabs(v) * 1.0 / 256 + 1e-30);
  }
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  // 1 + 2^-8 is a tie between 1 and 1 + 2^-7: round to even (1).
  EXPECT_EQ(f32_to_bf16(1.0f + 1.0f / 256), 0x3f80);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(NAN))));
}

TEST(DType, F16Exact) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = f16_to_f32(uint16_t(h));
    if (std::isnan(f)) continue;
    EXPECT_EQ(f32_to_f16(f), h) << h;
  }
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);  // rounds to inf
  EXPECT_FLOAT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));
}

TEST(DType, F8E4M3Exact) {
  for (uint32_t v = 0; v < 256; ++v) {
    const float f = f8e4m3_to_f32(uint8_t(v));
    if (std::isnan(f)) continue;
    EXPECT_EQ(f32_to_f8e4m3(f), v) << v;
  }
  EXPECT_FLOAT_EQ(f8e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(f32_to_f8e4m3(1000.0f), 0x7e);  // saturates
  EXPECT_EQ(f32_to_f8e4m3(-1000.0f), 0xfe);
  EXPECT_FLOAT_EQ(f8e4m3_to_f32(0x01), std::ldexp(1.0f, -9));
}

TEST(DType, F4E2M1AndUe8m0) {
  const float vals[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (int i = 0; i < 8; ++i) {
    EXPECT_FLOAT_EQ(f4e2m1_to_f32(uint8_t(i)), vals[i]);
    EXPECT_EQ(f32_to_f4e2m1(vals[i]), i);
    EXPECT_FLOAT_EQ(f4e2m1_to_f32(uint8_t(i | 8)), -vals[i]);
  }
  EXPECT_EQ(f32_to_f4e2m1(100.0f), 7);
  EXPECT_FLOAT_EQ(ue8m0_to_f32(127), 1.0f);
  EXPECT_EQ(f32_to_ue8m0(1.0f), 127);
  EXPECT_EQ(f32_to_ue8m0(1.5f), 128);  // rounded up to 2
  EXPECT_EQ(f32_to_ue8m0(0.25f), 125);
}

TEST(Tensor, ShapesStridesAndErrors) {
  Tensor t = Tensor::zeros({2, 3}, DType::f32);
  EXPECT_EQ(t.numel(), 6);
  EXPECT_EQ(t.view().stride(0), 3);
  EXPECT_THROW(t.size(2), Error);
  EXPECT_THROW(t.reshape({4, 2}), Error);
  TensorView tv(t.data(), DType::f32, {3, 2}, Device::cpu(), {1, 3});
  EXPECT_FALSE(tv.is_contiguous());
  Tensor c = Tensor::copy_of(tv, Device::cpu());
  EXPECT_TRUE(c.view().is_contiguous());
  EXPECT_THROW(Device::parse("tpu"), Error);
  EXPECT_EQ(Device::parse("cuda:1").index, 1);
  EXPECT_THROW(parse_dtype("f13"), Error);
  try {
    parse_dtype("f13");
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("f13"), std::string::npos);
  }
}

TEST(Registry, ListsEveryBackendAndRejectsUnknownNames) {
  auto names = ExpertsInterface::global().names();
  for (const char* n : {"eager", "batched_mm", "grouped_mm", "deepgemm", "sonicmoe", "deepgemm_megamoe"})
    EXPECT_NE(std::find(names.begin(), names.end(), n), names.end()) << n;
  try {
    ExpertsInterface::global().get("nope");
    FAIL() << "unknown name accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::not_found);
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'nope'"), std::string::npos);
    for (const char* n : {"eager", "batched_mm", "grouped_mm", "deepgemm", "sonicmoe", "deepgemm_megamoe"})
      EXPECT_NE(msg.find(n), std::string::npos) << n;
  }
  EXPECT_THROW(ExpertsInterface::global().unregister_backend("eager"), Error);
  for (auto& b : ExpertsInterface::global().backends()) {
    Support s = b->available(Device::cpu());
    if (!s) EXPECT_FALSE(s.reason.empty()) << b->name();
  }
}

// Settings read from the environment (base/env.h): integers, fallbacks, a switch read once and overridden.
TEST(Env, IntegersSwitchesAndFallbacks) {
  const char* name = "MOEKIT_TEST_ENV_SETTING";
  ::unsetenv(name);
  EXPECT_EQ(env_int(name, 7), 7);
  for (const auto& [value, want] : std::vector<std::pair<const char*, int64_t>>{
           {"", 7}, {"12", 12}, {"-3", -3}, {"0", 0}, {"4x", 7}, {"x4", 7}, {" ", 7}}) {
    ::setenv(name, value, 1);
    EXPECT_EQ(env_int(name, 7), want) << "'" << value << "'";
  }
  ::setenv(name, "70", 1);
  EXPECT_EQ(env_int_in(name, 1, 64, 8), 8);
  ::setenv(name, "64", 1);
  EXPECT_EQ(env_int_in(name, 1, 64, 8), 64);
  ::setenv(name, "0", 1);
  EXPECT_EQ(env_int_in(name, 1, 64, 8), 8);
  EnvSwitch off{name, true};
  EXPECT_FALSE(off.on());
  ::setenv(name, "1", 1);
  EXPECT_FALSE(off.on());  // read once
  EXPECT_FALSE(off.set(true));
  EXPECT_TRUE(off.on());
  ::setenv(name, "junk", 1);
  EnvSwitch fallback_on{name, true}, fallback_off{name, false};
  EXPECT_TRUE(fallback_on.on());
  EXPECT_FALSE(fallback_off.on());
  ::unsetenv(name);
}
