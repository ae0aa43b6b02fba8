# moekit: install rules and the CMake package / pkg-config files.
#   cmake --install BUILD --prefix PREFIX   installs
#     lib/libmoekit.{a,so}                  the library (MOEKIT_SHARED picks which)
#     include/moekit/*.h                    the public headers
#     lib/cmake/moekit/                     moekitConfig.cmake, its version file, the moekit::moekit target
#     lib/pkgconfig/moekit.pc
#     bin/moekit                            the CLI (MOEKIT_BUILD_CLI)
if(NOT MOEKIT_INSTALL)
  return()
endif()
include(CMakePackageConfigHelpers)

set(MOEKIT_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/moekit CACHE STRING
    "Where moekitConfig.cmake is installed, relative to the prefix")
mark_as_advanced(MOEKIT_INSTALL_CMAKEDIR)

set_target_properties(moekit PROPERTIES EXPORT_NAME moekit)
install(TARGETS moekit EXPORT moekitTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT moekit_development
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT moekit_runtime NAMELINK_COMPONENT moekit_development
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT moekit_runtime
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/moekit DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        COMPONENT moekit_development FILES_MATCHING PATTERN "*.h")
install(FILES ${PROJECT_BINARY_DIR}/include/moekit/version.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/moekit
        COMPONENT moekit_development)
install(EXPORT moekitTargets NAMESPACE moekit:: DESTINATION ${MOEKIT_INSTALL_CMAKEDIR}
        COMPONENT moekit_development)

if(MOEKIT_BUILD_CLI)
  install(TARGETS moekit_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT moekit_runtime)
endif()

# What a consumer must find for the exported target: a static libmoekit brings its private link
# dependencies (OpenMP, and the CUDA libraries when built with CUDA) onto the consumer's link line.
get_target_property(MOEKIT_LIBRARY_TYPE moekit TYPE)
set(MOEKIT_CONFIG_STATIC OFF)
if(MOEKIT_LIBRARY_TYPE STREQUAL "STATIC_LIBRARY")
  set(MOEKIT_CONFIG_STATIC ON)
endif()
set(MOEKIT_CONFIG_CUDA ${MOEKIT_WITH_CUDA})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/moekitConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/moekitConfig.cmake
                              INSTALL_DESTINATION ${MOEKIT_INSTALL_CMAKEDIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/moekitConfigVersion.cmake
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/moekitConfig.cmake ${PROJECT_BINARY_DIR}/moekitConfigVersion.cmake
        DESTINATION ${MOEKIT_INSTALL_CMAKEDIR} COMPONENT moekit_development)

# pkg-config: Libs.private lists what a static link also needs.
set(MOEKIT_PC_LIBS_PRIVATE "-fopenmp -lpthread")
set(MOEKIT_PC_CFLAGS "")
if(MOEKIT_WITH_CUDA)
  set(MOEKIT_PC_CFLAGS "-DMOEKIT_WITH_CUDA=1")
  string(APPEND MOEKIT_PC_LIBS_PRIVATE " -L${CUDAToolkit_LIBRARY_DIR} -lcublasLt -lcublas -lcudart")
endif()
# Expert parallelism's engines, by path (a static link needs them too).
if(MOEKIT_WITH_MPI)
  foreach(lib ${MPI_CXX_LIBRARIES})
    string(APPEND MOEKIT_PC_LIBS_PRIVATE " ${lib}")
  endforeach()
endif()
if(MOEKIT_WITH_NCCL)
  string(APPEND MOEKIT_PC_LIBS_PRIVATE " ${MOEKIT_NCCL_LIBRARY}")
endif()
# prefix from the .pc file's own place, so that `cmake --install --prefix` elsewhere stays right.
if(IS_ABSOLUTE "${CMAKE_INSTALL_LIBDIR}")
  set(MOEKIT_PC_PREFIX "${CMAKE_INSTALL_PREFIX}")
else()
  file(RELATIVE_PATH MOEKIT_PC_UP "/prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/prefix")
  set(MOEKIT_PC_PREFIX "\${pcfiledir}/${MOEKIT_PC_UP}")
endif()
if(IS_ABSOLUTE "${CMAKE_INSTALL_LIBDIR}")
  set(MOEKIT_PC_LIBDIR "${CMAKE_INSTALL_LIBDIR}")
else()
  set(MOEKIT_PC_LIBDIR "\${prefix}/${CMAKE_INSTALL_LIBDIR}")
endif()
if(IS_ABSOLUTE "${CMAKE_INSTALL_INCLUDEDIR}")
  set(MOEKIT_PC_INCLUDEDIR "${CMAKE_INSTALL_INCLUDEDIR}")
else()
  set(MOEKIT_PC_INCLUDEDIR "\${prefix}/${CMAKE_INSTALL_INCLUDEDIR}")
endif()
configure_file(${PROJECT_SOURCE_DIR}/cmake/moekit.pc.in ${PROJECT_BINARY_DIR}/moekit.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/moekit.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig
        COMPONENT moekit_development)
