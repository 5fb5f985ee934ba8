# The libraries rannc builds against, as imported targets named after third_party/BUILD's
# (rannc::torch, rannc::grpc, ...), plus protoc and grpc_cpp_plugin.
#
# LibTorch comes from find_package(Torch): Torch_DIR or CMAKE_PREFIX_PATH (Debian's libtorch-dev
# is found with neither). Everything else is found as third_party/system.BUILD takes it, by
# header and library name, in RANNC_SYS_PREFIX/usr first (Debian 12 .debs unpacked with
# `dpkg -x`, as on the GPU machine) and then on the system. Debian's own CMake package files are
# not used for these: some are not relocatable (UCX's names /usr), and gRPC's finds re2 through
# pkg-config, whose .pc files name /usr too; linking the shared libraries directly needs neither.
include_guard(GLOBAL)

set(RANNC_SYS_PREFIX "" CACHE PATH
    "Root of unpacked Debian .debs (holding usr/include, usr/lib/<arch>, usr/bin) searched before the system")
set(RANNC_PYTHON "/usr/bin/python3" CACHE FILEPATH
    "Python with the PyTorch that matches LibTorch: makes the tests' fixture models, finds NCCL")
set(RANNC_NCCL_ROOT "" CACHE PATH
    "NCCL's root (include/nccl.h, lib/libnccl.so*); default: python's nvidia.nccl package, else CUDA's")

# RANNC_TOOL_ENV: prefix for build-time commands (protoc), which need the prefix's libraries.
set(RANNC_TOOL_ENV)
if(RANNC_SYS_PREFIX)
  list(PREPEND CMAKE_PREFIX_PATH "${RANNC_SYS_PREFIX}/usr")
  # Before every other include directory, LibTorch's too: pip's LibTorch ships the headers of
  # another protobuf (google/protobuf) than the prefix's library.
  include_directories(BEFORE SYSTEM "${RANNC_SYS_PREFIX}/usr/include")
  set(RANNC_TOOL_ENV "${CMAKE_COMMAND}" -E env
      "LD_LIBRARY_PATH=${RANNC_SYS_PREFIX}/usr/lib/${CMAKE_LIBRARY_ARCHITECTURE}:$ENV{LD_LIBRARY_PATH}")
endif()

find_package(Threads REQUIRED)

# rannc_import_library(<target> PACKAGE <debian-package> HEADER <file> [LIBS name...]
#                      [DEFINES def...] [DEPS target...])
# An imported target whose include directory holds HEADER and which links each LIBS by name.
function(rannc_import_library target)
  cmake_parse_arguments(PARSE_ARGV 1 ARG "" "PACKAGE;HEADER" "LIBS;DEFINES;DEPS")
  set(hint "install Debian's ${ARG_PACKAGE}, or give -DRANNC_SYS_PREFIX=DIR where its .deb is unpacked")
  string(MAKE_C_IDENTIFIER "RANNC_INCLUDE_${ARG_HEADER}" include_var)
  find_path(${include_var} "${ARG_HEADER}")
  if(NOT ${include_var})
    message(FATAL_ERROR "${target}: no ${ARG_HEADER} found; ${hint}")
  endif()
  add_library(${target} INTERFACE IMPORTED GLOBAL)
  target_include_directories(${target} INTERFACE "${${include_var}}")
  foreach(lib IN LISTS ARG_LIBS)
    string(MAKE_C_IDENTIFIER "RANNC_LIBRARY_${lib}" lib_var)
    find_library(${lib_var} "${lib}")
    if(NOT ${lib_var})
      message(FATAL_ERROR "${target}: no lib${lib}.so found; ${hint}")
    endif()
    target_link_libraries(${target} INTERFACE "${${lib_var}}")
  endforeach()
  target_compile_definitions(${target} INTERFACE ${ARG_DEFINES})
  target_link_libraries(${target} INTERFACE ${ARG_DEPS})
endfunction()

# LibTorch. Its C++ ABI must be the one Debian's libraries (gRPC, abseil, ...) were built with.
find_package(Torch REQUIRED)
if(TORCH_CXX_FLAGS MATCHES "_GLIBCXX_USE_CXX11_ABI=0")
  message(FATAL_ERROR "LibTorch at ${TORCH_INSTALL_PREFIX} uses the pre-C++11 ABI; gRPC and the other "
                      "Debian libraries use the C++11 ABI: take a cxx11-abi LibTorch")
endif()
add_library(rannc::torch INTERFACE IMPORTED GLOBAL)
target_link_libraries(rannc::torch INTERFACE ${TORCH_LIBRARIES})
message(STATUS "LibTorch ${Torch_VERSION} at ${TORCH_INSTALL_PREFIX}")

rannc_import_library(rannc::protobuf PACKAGE libprotobuf-dev
  HEADER google/protobuf/message.h LIBS protobuf)
rannc_import_library(rannc::absl PACKAGE libabsl-dev
  HEADER absl/status/statusor.h
  LIBS absl_statusor absl_status absl_cord absl_cordz_info absl_cord_internal
       absl_cordz_functions absl_cordz_handle absl_str_format_internal absl_strings
       absl_strings_internal absl_synchronization absl_time absl_base
       absl_raw_logging_internal absl_throw_delegate)
rannc_import_library(rannc::grpc PACKAGE libgrpc++-dev
  HEADER grpcpp/grpcpp.h LIBS grpc++ grpc gpr DEPS rannc::absl rannc::protobuf)
rannc_import_library(rannc::spdlog PACKAGE "libspdlog-dev and libfmt-dev"
  HEADER spdlog/spdlog.h LIBS spdlog fmt
  DEFINES SPDLOG_SHARED_LIB SPDLOG_COMPILED_LIB SPDLOG_FMT_EXTERNAL DEPS Threads::Threads)
# OpenSSL's libcrypto (libssl-dev), as third_party/system.BUILD takes it; CMake's own FindOpenSSL
# looks in RANNC_SYS_PREFIX/usr first too (CMAKE_PREFIX_PATH).
find_package(OpenSSL REQUIRED COMPONENTS Crypto)
add_library(rannc::openssl INTERFACE IMPORTED GLOBAL)
target_link_libraries(rannc::openssl INTERFACE OpenSSL::Crypto)
rannc_import_library(rannc::prometheus PACKAGE prometheus-cpp-dev
  HEADER prometheus/text_serializer.h LIBS prometheus-cpp-core)
rannc_import_library(rannc::ucx PACKAGE libucx-dev HEADER ucp/api/ucp.h LIBS ucp uct ucs)
# Header-only, as Bazel uses them.
rannc_import_library(rannc::toml PACKAGE libtomlplusplus-dev HEADER toml++/toml.h)
rannc_import_library(rannc::cli11 PACKAGE libcli11-dev HEADER CLI/CLI.hpp)
if(RANNC_BUILD_TESTS)
  rannc_import_library(rannc::catch2 PACKAGE catch2 HEADER catch2/catch.hpp)
endif()

find_program(RANNC_PROTOC protoc)
find_program(RANNC_GRPC_CPP_PLUGIN grpc_cpp_plugin)
if(NOT RANNC_PROTOC OR NOT RANNC_GRPC_CPP_PLUGIN)
  message(FATAL_ERROR "protoc and grpc_cpp_plugin are needed: install Debian's protobuf-compiler "
                      "and protobuf-compiler-grpc, or give -DRANNC_SYS_PREFIX")
endif()

# etcd's v3 gRPC API (third_party/etcd/BUILD): generated by third_party/etcd/gen.sh from the
# .proto files of Debian's golang-etcd-server-dev and the two packages whose annotations they
# import, under RANNC_SYS_PREFIX's usr/share/gocode/src or the system's.
set(RANNC_GOCODE_SRC "" CACHE PATH
    "Where Debian's golang-*-dev packages keep their sources (default: usr/share/gocode/src)")
if(NOT RANNC_GOCODE_SRC)
  set(RANNC_GOCODE_SRC "/usr/share/gocode/src")
  if(RANNC_SYS_PREFIX AND EXISTS "${RANNC_SYS_PREFIX}/usr/share/gocode/src/go.etcd.io")
    set(RANNC_GOCODE_SRC "${RANNC_SYS_PREFIX}/usr/share/gocode/src")
  endif()
endif()
if(NOT EXISTS "${RANNC_GOCODE_SRC}/go.etcd.io/etcd/etcdserver/etcdserverpb/rpc.proto")
  message(FATAL_ERROR "etcd's .proto files are not under ${RANNC_GOCODE_SRC}: install Debian's "
                      "golang-etcd-server-dev, or give -DRANNC_SYS_PREFIX / -DRANNC_GOCODE_SRC")
endif()
set(etcd_out "${CMAKE_BINARY_DIR}/third_party/etcd")
set(etcd_outputs)
foreach(proto gogoproto/gogo google/api/http google/api/annotations etcd/mvcc/mvccpb/kv
              etcd/auth/authpb/auth etcd/etcdserver/etcdserverpb/rpc
              etcd/etcdserver/api/v3election/v3electionpb/v3election)
  foreach(suffix .pb.h .pb.cc .grpc.pb.h .grpc.pb.cc)
    list(APPEND etcd_outputs "${etcd_out}/${proto}${suffix}")
  endforeach()
endforeach()
add_custom_command(
  OUTPUT ${etcd_outputs}
  COMMAND ${RANNC_TOOL_ENV} "${CMAKE_CURRENT_LIST_DIR}/../third_party/etcd/gen.sh" "${etcd_out}"
          "${RANNC_GOCODE_SRC}" "${RANNC_PROTOC}" "${RANNC_GRPC_CPP_PLUGIN}"
          "${RANNC_INCLUDE_google_protobuf_message_h}"
  DEPENDS "${CMAKE_CURRENT_LIST_DIR}/../third_party/etcd/gen.sh"
  COMMENT "protoc: etcd's v3 API"
  VERBATIM)
add_library(rannc_etcd_api STATIC ${etcd_outputs})
target_include_directories(rannc_etcd_api PUBLIC "${etcd_out}")
target_compile_options(rannc_etcd_api PRIVATE -w)  # protoc's code, not ours
target_link_libraries(rannc_etcd_api PUBLIC rannc::grpc rannc::protobuf)
add_library(rannc::etcd ALIAS rannc_etcd_api)

# CUDA's runtime and NCCL, for the NCCL backend (third_party/cuda.BUILD).
if(RANNC_WITH_NCCL)
  find_package(CUDAToolkit REQUIRED)
  set(nccl_hints)
  if(RANNC_NCCL_ROOT)
    list(APPEND nccl_hints "${RANNC_NCCL_ROOT}")
  else()
    execute_process(
      COMMAND "${RANNC_PYTHON}" -c "import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])"
      OUTPUT_VARIABLE pip_nccl OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(pip_nccl)
      list(APPEND nccl_hints "${pip_nccl}")
    endif()
  endif()
  get_filename_component(cuda_root "${CUDAToolkit_LIBRARY_DIR}" DIRECTORY)
  list(APPEND nccl_hints "${cuda_root}")
  # The hints first: the toolkit's own nccl.h, if any, may be another version than the library.
  find_path(RANNC_NCCL_INCLUDE_DIR nccl.h HINTS ${nccl_hints} PATH_SUFFIXES include NO_DEFAULT_PATH)
  find_path(RANNC_NCCL_INCLUDE_DIR nccl.h)
  # pip's nvidia-nccl has libnccl.so.2 only (no libnccl.so link).
  find_library(RANNC_NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${nccl_hints}
               PATH_SUFFIXES lib lib64 NO_DEFAULT_PATH)
  find_library(RANNC_NCCL_LIBRARY NAMES nccl libnccl.so.2)
  if(NOT RANNC_NCCL_INCLUDE_DIR OR NOT RANNC_NCCL_LIBRARY)
    message(FATAL_ERROR "RANNC_WITH_NCCL: no nccl.h / libnccl found (looked in ${nccl_hints}); "
                        "give -DRANNC_NCCL_ROOT=DIR")
  endif()
  message(STATUS "NCCL: ${RANNC_NCCL_INCLUDE_DIR}, ${RANNC_NCCL_LIBRARY}")
  add_library(rannc::cuda INTERFACE IMPORTED GLOBAL)
  target_include_directories(rannc::cuda INTERFACE "${RANNC_NCCL_INCLUDE_DIR}")
  target_link_libraries(rannc::cuda INTERFACE "${RANNC_NCCL_LIBRARY}" CUDA::cudart)
endif()
