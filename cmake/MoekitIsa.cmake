# The compile flags of the ISA-specific CPU micro-kernels (chosen at run time): *_avx2.cpp, *_avx512.cpp,
# gemm_avx512bf16.cpp (vdpbf16ps) and gemm_amx.cpp (AMX tiles; VBMI byte tables for FP8). One list for the
# library and for the fuzzing build. Call from the directory whose targets compile these files.
function(moekit_isa_flags root)
  file(GLOB avx2 CONFIGURE_DEPENDS ${root}/src/base/*_avx2.cpp ${root}/src/backends/cpu/*_avx2.cpp)
  file(GLOB avx512 CONFIGURE_DEPENDS ${root}/src/base/*_avx512.cpp ${root}/src/backends/cpu/*_avx512.cpp)
  set(avx512_base -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c)
  set_source_files_properties(${avx2} PROPERTIES COMPILE_OPTIONS "-mavx2;-mfma;-mf16c")
  set_source_files_properties(${avx512} PROPERTIES COMPILE_OPTIONS "${avx512_base}")
  set_source_files_properties(${root}/src/base/gemm_avx512bf16.cpp PROPERTIES COMPILE_OPTIONS
                              "${avx512_base};-mavx512bf16")
  set_source_files_properties(${root}/src/base/gemm_amx.cpp PROPERTIES COMPILE_OPTIONS
                              "${avx512_base};-mavx512bf16;-mamx-tile;-mamx-bf16;-mavx512vbmi")
endfunction()
