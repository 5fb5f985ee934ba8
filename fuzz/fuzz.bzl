"""rannc_fuzz_target: a libFuzzer target and the CI test that replays its seed corpus."""

def rannc_fuzz_target(name, srcs, deps, corpus = None, testonly = False):
    """`name`_fuzzer: the target (libFuzzer under --config=fuzz, else the standalone driver);
    `name`_corpus_test: the driver over corpus/`name` (every file must run without a crash).
    `testonly`: the target links test helpers (a fixture model)."""
    corpus = corpus or "corpus/" + name
    native.cc_binary(
        name = name + "_fuzzer",
        srcs = srcs,
        copts = ["-Wall"],
        linkopts = select({
            "//fuzz:libfuzzer": ["-fsanitize=fuzzer"],
            "//conditions:default": [],
        }),
        deps = deps + ["//fuzz:standalone_main"],
        testonly = testonly,
    )
    native.sh_test(
        name = name + "_corpus_test",
        size = "small",
        srcs = ["corpus_test.sh"],
        args = ["$(location :%s_fuzzer)" % name, "fuzz/" + corpus],
        data = [":" + name + "_fuzzer"] + native.glob([corpus + "/*"]),
    )
