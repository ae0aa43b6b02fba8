// moekit: one include for users.
#pragma once
#include "moekit/dtype.h"
#include "moekit/error.h"
#include "moekit/experts.h"
#include "moekit/interface.h"
#include "moekit/parallel.h"
#include "moekit/quant.h"
#include "moekit/tensor.h"
#include "moekit/tokenizer.h"
#if __has_include("moekit/model.h")
#include "moekit/model.h"
#endif
