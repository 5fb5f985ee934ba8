# Bazel's cc_library / cc_binary / cc_test and the proto genrules, in CMake: each BUILD file has a
# CMakeLists.txt beside it that calls these with the same sources, dependencies, copts and
# defines, so the two builds stay easy to compare target by target.
#
# Naming: a library is its Bazel label with '/' and ':' as '_' (//daemon/common:status is
# daemon_common_status), since names like "status" or "planner" would clash in CMake's one
# namespace. Binaries and tests keep their Bazel names (ranncd, rannc, status_test), which are
# unique, and land in the build tree where bazel-bin puts them (build/daemon/ranncd).
#
# Tests (RANNC_BUILD_TESTS) run as under `bazel test`: from the build tree's root, which holds
# everything a test reads the way Bazel's runfiles root does (tests/fixtures/*.pt,
# daemon/ranncd, ...), with TEST_SRCDIR/TEST_WORKSPACE pointing there and an empty TEST_TMPDIR
# of their own (cmake/run_test.sh).
include_guard(GLOBAL)

# rannc_cc_library(<name> [SRCS file...] [HDRS file...] [DEPS target...] [COPTS opt...]
#                  [DEFINES def...] [TESTONLY])
# SRCS empty: a header-only (INTERFACE) library. DEFINES are Bazel's local_defines (private).
# TESTONLY libraries exist only with RANNC_BUILD_TESTS.
function(rannc_cc_library name)
  cmake_parse_arguments(PARSE_ARGV 1 ARG "TESTONLY" "" "SRCS;HDRS;DEPS;COPTS;DEFINES")
  if(ARG_TESTONLY AND NOT RANNC_BUILD_TESTS)
    return()
  endif()
  if(NOT ARG_SRCS)
    add_library(${name} INTERFACE)
    target_link_libraries(${name} INTERFACE ${ARG_DEPS})
    return()
  endif()
  add_library(${name} STATIC ${ARG_SRCS} ${ARG_HDRS})
  target_link_libraries(${name} PUBLIC ${ARG_DEPS})
  target_compile_options(${name} PRIVATE ${ARG_COPTS})
  target_compile_definitions(${name} PRIVATE ${ARG_DEFINES})
endfunction()

# rannc_cc_binary(<name> SRCS file... [DEPS target...] [COPTS opt...] [TESTONLY])
function(rannc_cc_binary name)
  cmake_parse_arguments(PARSE_ARGV 1 ARG "TESTONLY" "" "SRCS;DEPS;COPTS")
  if(ARG_TESTONLY AND NOT RANNC_BUILD_TESTS)
    return()
  endif()
  add_executable(${name} ${ARG_SRCS})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS})
  target_compile_options(${name} PRIVATE ${ARG_COPTS})
endfunction()

# rannc_cc_test(<name> SRCS file... [DEPS target...] [COPTS opt...] [DEFINES def...]
#               [DATA target...] [SIZE small|medium|large] [TAGS tag...] [ENV VAR=value...])
# Links the shared Catch2 main; DATA targets (binaries it starts) are built before it. SIZE
# gives Bazel's timeout (60/300/900 s, default medium); TAGS become ctest labels (`ctest -LE gpu`
# skips them as --test_tag_filters=-gpu does), and "exclusive" runs the test alone. The ctest
# name is the Bazel label (daemon/common:status_test).
function(rannc_cc_test name)
  cmake_parse_arguments(PARSE_ARGV 1 ARG "" "SIZE" "SRCS;DEPS;COPTS;DEFINES;DATA;TAGS;ENV")
  if(NOT RANNC_BUILD_TESTS)
    return()
  endif()
  add_executable(${name} ${ARG_SRCS})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} third_party_catch2_main)
  target_compile_options(${name} PRIVATE ${ARG_COPTS})
  target_compile_definitions(${name} PRIVATE ${ARG_DEFINES})
  if(ARG_DATA)
    add_dependencies(${name} ${ARG_DATA})
  endif()

  file(RELATIVE_PATH package "${PROJECT_SOURCE_DIR}" "${CMAKE_CURRENT_SOURCE_DIR}")
  set(test "${package}:${name}")
  add_test(NAME ${test}
    COMMAND "${PROJECT_SOURCE_DIR}/cmake/run_test.sh" $<TARGET_FILE:${name}>
    WORKING_DIRECTORY "${PROJECT_BINARY_DIR}")
  set(timeout 300)
  if(ARG_SIZE STREQUAL "small")
    set(timeout 60)
  elseif(ARG_SIZE STREQUAL "large")
    set(timeout 900)
  endif()
  get_filename_component(runfiles_root "${PROJECT_BINARY_DIR}" DIRECTORY)
  get_filename_component(workspace "${PROJECT_BINARY_DIR}" NAME)
  set(env "TEST_SRCDIR=${runfiles_root}" "TEST_WORKSPACE=${workspace}" ${ARG_ENV})
  set_tests_properties(${test} PROPERTIES TIMEOUT ${timeout} ENVIRONMENT "${env}")
  if(ARG_TAGS)
    set_tests_properties(${test} PROPERTIES LABELS "${ARG_TAGS}")
  endif()
  if("exclusive" IN_LIST ARG_TAGS)
    set_tests_properties(${test} PROPERTIES RUN_SERIAL TRUE)
  endif()
endfunction()

# rannc_cc_proto_library(<name> PROTOS file... [DEPS target...])
# Generates the messages (.pb.h/.cc) and gRPC stubs (.grpc.pb.h/.cc) of PROTOS (paths under
# proto/) with protoc and grpc_cpp_plugin in one run, as proto/BUILD's genrules do, and compiles
# them into one library. Its users include "rannc/v1/NAME.pb.h".
function(rannc_cc_proto_library name)
  cmake_parse_arguments(PARSE_ARGV 1 ARG "" "" "PROTOS;DEPS")
  set(out_dir "${CMAKE_CURRENT_BINARY_DIR}")
  set(inputs)
  set(outputs)
  foreach(proto IN LISTS ARG_PROTOS)
    string(REGEX REPLACE "\\.proto$" "" stem "${proto}")
    list(APPEND inputs "${CMAKE_CURRENT_SOURCE_DIR}/${proto}")
    foreach(suffix .pb.h .pb.cc .grpc.pb.h .grpc.pb.cc)
      list(APPEND outputs "${out_dir}/${stem}${suffix}")
    endforeach()
  endforeach()
  add_custom_command(
    OUTPUT ${outputs}
    COMMAND ${RANNC_TOOL_ENV} "${RANNC_PROTOC}" "-I${CMAKE_CURRENT_SOURCE_DIR}"
            "--cpp_out=${out_dir}" "--grpc_out=${out_dir}"
            "--plugin=protoc-gen-grpc=${RANNC_GRPC_CPP_PLUGIN}" ${inputs}
    DEPENDS ${inputs}
    COMMENT "protoc: ${ARG_PROTOS}"
    VERBATIM)
  add_library(${name} STATIC ${outputs})
  target_include_directories(${name} PUBLIC "${out_dir}")
  target_link_libraries(${name} PUBLIC ${ARG_DEPS})
endfunction()
