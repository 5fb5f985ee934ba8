"""The LibTorch that Bazel builds against: Debian's by default, or one given by path.

    bazel build --repo_env=RANNC_LIBTORCH=/path/to/libtorch //daemon:ranncd

RANNC_LIBTORCH is a LibTorch root holding include/ and lib/: an unzipped libtorch download, or a
pip PyTorch's package directory (python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))').
It must use the C++11 ABI, as Debian's gRPC and abseil do. Unset, @libtorch//:torch is Debian's
libtorch-dev (@system//:torch), so the default build is unchanged. Setting or changing it
re-runs this rule; docs/building.md has more.
"""

# Entries of LibTorch's include/ that are not its own API: a pip LibTorch ships the protobuf
# headers it was built with, which must not shadow those of the system's libprotobuf.
_SKIPPED_INCLUDES = ["google"]

_BUILD_DEFAULT = """\
# Debian's libtorch-dev (third_party/system.BUILD); RANNC_LIBTORCH was not set.
alias(
    name = "torch",
    actual = "@system//:torch",
    visibility = ["//visibility:public"],
)
"""

_BUILD_GIVEN = """\
# LibTorch from RANNC_LIBTORCH={root}.
cc_library(
    name = "torch",
    hdrs = glob(["include/**"]),
    includes = [
        "include",
        "include/torch/csrc/api/include",
    ],
    linkopts = [
        "-L{root}/lib",
        "-Wl,-rpath,{root}/lib",
        "-ltorch",
        "-ltorch_cpu",
        "-lc10",
    ] + {cuda_linkopts},
    visibility = ["//visibility:public"],
)
"""

def _libtorch_repository_impl(rctx):
    root = rctx.os.environ.get("RANNC_LIBTORCH", "")
    if not root:
        rctx.file("BUILD.bazel", _BUILD_DEFAULT)
        return
    include = rctx.path(root + "/include")
    if not include.exists or not rctx.path(root + "/lib").exists:
        fail("RANNC_LIBTORCH=%s has no include/ and lib/; give a LibTorch root" % root)
    for entry in include.readdir():
        if entry.basename not in _SKIPPED_INCLUDES:
            rctx.symlink(entry, "include/" + entry.basename)

    # A CUDA LibTorch registers its CUDA kernels from libtorch_cuda, which no symbol of ours
    # references: link it even so.
    cuda_linkopts = []
    if rctx.path(root + "/lib/libtorch_cuda.so").exists:
        cuda_linkopts = [
            "-Wl,--push-state,--no-as-needed",
            "-ltorch_cuda",
            "-lc10_cuda",
            "-Wl,--pop-state",
        ]
    rctx.file("BUILD.bazel", _BUILD_GIVEN.format(root = root, cuda_linkopts = repr(cuda_linkopts)))

libtorch_repository = repository_rule(
    implementation = _libtorch_repository_impl,
    environ = ["RANNC_LIBTORCH"],
    local = True,
)
