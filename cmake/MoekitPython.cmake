# moekit: the Python extension moekit._moekit (nanobind), built by `pip install .` (pyproject.toml sets
# MOEKIT_PYTHON=ON, and turns the CLI, the tests and the C++ install rules off). libmoekit is linked
# statically into it.
if(NOT MOEKIT_PYTHON)
  return()
endif()
find_package(Python 3.9 REQUIRED COMPONENTS Interpreter Development.Module)
if(NOT nanobind_DIR)
  execute_process(COMMAND ${Python_EXECUTABLE} -m nanobind --cmake_dir OUTPUT_VARIABLE nanobind_DIR
                  OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
endif()
find_package(nanobind CONFIG REQUIRED)
if(MOEKIT_SHARED)
  message(FATAL_ERROR "MOEKIT_PYTHON links libmoekit statically: turn MOEKIT_SHARED off")
endif()
nanobind_add_module(_moekit NB_STATIC ${PROJECT_SOURCE_DIR}/python/src/moekit_python.cpp)
target_link_libraries(_moekit PRIVATE moekit)
# Everything linked from archives (libmoekit, the static CUDA runtime) stays inside the module and binds there:
# nothing is exported for torch's libraries to interpose, or to interpose on theirs.
target_link_options(_moekit PRIVATE -Wl,--exclude-libs,ALL)
target_compile_options(_moekit PRIVATE ${MOEKIT_WARNINGS})
install(TARGETS _moekit LIBRARY DESTINATION moekit COMPONENT python)
