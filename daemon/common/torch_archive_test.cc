// The checks on an archive before LibTorch reads it: real archives pass; stated sizes
// beyond the bytes sent (which LibTorch would allocate) are refused, naming the record.
#include "daemon/common/torch_archive.h"

// LibTorch's headers (through fixture.h) before Catch's: LibTorch's logging defines a CHECK too.
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <catch2/catch.hpp>

#include "tests/fixtures/fixture.h"

namespace rannc {
namespace {

using Catch::Matchers::Contains;

std::string Message(const absl::Status& s) { return std::string(s.message()); }

const ZipRecord* Find(const std::vector<ZipRecord>& records, const std::string& suffix) {
  for (const ZipRecord& r : records) {
    if (r.name.size() >= suffix.size() &&
        r.name.compare(r.name.size() - suffix.size(), suffix.size(), suffix) == 0) {
      return &r;
    }
  }
  return nullptr;
}

TEST_CASE("the test fixtures' archives pass, and their records are found", "[graph]") {
  for (const char* name : {"mlp", "tied_lm", "bn_net", "multi_io"}) {
    const std::string bytes = testing::LoadFixture(name).model_bytes;
    absl::StatusOr<std::vector<ZipRecord>> records = ReadZipDirectory(bytes, "the model archive");
    REQUIRE(records.ok());
    CHECK(Find(*records, "/data.pkl") != nullptr);
    CHECK(Find(*records, "/constants.pkl") != nullptr);
    CHECK(Find(*records, "debug_pkl") != nullptr);
    CHECK(CheckTorchArchive(bytes, "the model archive").ok());
  }
}

TEST_CASE("a pickle's stated lengths and memo indices are bounded by its bytes", "[graph]") {
  // Protocol 2: a list of a short unicode string, memoized and fetched again.
  const std::string good = std::string("\x80\x02]q\x00(X\x02\x00\x00\x00hih\x00" "e.", 17);
  CHECK(CheckPickle(good, "test").ok());

  // Every strict prefix is truncated somewhere: an error, never a read past the end.
  for (size_t n = 0; n < good.size(); ++n) CHECK(!CheckPickle(good.substr(0, n), "test").ok());

  std::string huge = good;
  huge.replace(7, 4, "\xff\xff\xff\x7f", 4);  // BINUNICODE of 2^31-1 bytes
  absl::Status s = CheckPickle(huge, "'data.pkl'");
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(Message(s), Contains("'data.pkl'") && Contains("a length of 2147483647 bytes"));

  std::string bytes8 = std::string("\x80\x04\x8e", 3) + std::string(8, '\xff') + ".";
  CHECK_THAT(Message(CheckPickle(bytes8, "p")), Contains("a length of"));
  std::string negative = std::string("\x80\x02T\x00\x00\x00\x80.", 8);  // BINSTRING, < 0
  CHECK_THAT(Message(CheckPickle(negative, "p")), Contains("negative"));
  std::string frame = std::string("\x80\x04\x95", 3) + std::string("\xff\xff\xff\x00", 4) +
                      std::string(4, '\0') + "N.";
  CHECK_THAT(Message(CheckPickle(frame, "p")), Contains("a frame of"));

  // A memo index no PUT made (LibTorch reserves room for it).
  std::string far_put = good;
  far_put[4] = '\x05';  // BINPUT 5 as the first put
  CHECK_THAT(Message(CheckPickle(far_put, "p")), Contains("memo index 5 after 0 entries"));
  std::string far_get = std::string("\x80\x02]q\x00j\x00\x00\x00\x10.", 11);  // LONG_BINGET
  CHECK_THAT(Message(CheckPickle(far_get, "p")), Contains("memo index 268435456 of 1"));

  CHECK_THAT(Message(CheckPickle(std::string("\x80\x02\xff.", 4), "p")),
             Contains("unknown opcode 0xff"));

  // The stack: LibTorch's unpickler takes what an opcode says without checking it is there
  // (fuzz/corpus/torchscript_import/debug-pkl-stack-underflow: a MARK flipped to NEWOBJ made
  // it free what it had not allocated).
  CHECK_THAT(Message(CheckPickle(std::string("\x80\x02t.", 4), "p")),
             Contains("takes a mark where none is set"));
  CHECK_THAT(Message(CheckPickle(std::string("\x80\x02N\x87.", 5), "p")),
             Contains("takes 3 of the stack's 1 items"));
  CHECK_THAT(Message(CheckPickle(std::string("\x80\x02N(0.", 6), "p")),
             Contains("takes 1 of the stack's 0 items (above its last mark)"));
  CHECK(!CheckPickle(std::string("\x80\x02(Ne.", 6), "p").ok());  // APPENDS: no list below
  CHECK(!CheckPickle(std::string("\x80\x02(o.", 5), "p").ok());   // OBJ: no class
  CHECK(!CheckPickle(std::string("\x80\x02.", 3), "p").ok());     // STOP: nothing to return
  CHECK(!CheckPickle(std::string("\x80\x02N(N0\x85.", 8), "p").ok());  // TUPLE1 below a mark
  CHECK(CheckPickle(std::string("\x80\x02(N1N\x85.", 8), "p").ok());
  CHECK_THAT(Message(CheckPickle(std::string("\x80\x02N", 3), "p")), Contains("no STOP"));
}

TEST_CASE("a zip's stated sizes are bounded by the archive", "[graph]") {
  const std::string bytes = testing::LoadFixture("mlp").model_bytes;
  absl::StatusOr<std::vector<ZipRecord>> records = ReadZipDirectory(bytes, "the model archive");
  REQUIRE(records.ok());

  CHECK_THAT(Message(ReadZipDirectory("not a zip at all, just some text", "x").status()),
             Contains("no end-of-directory record"));
  CHECK(!ReadZipDirectory("", "x").ok());
  // Every strict suffix cut off: an error or fewer records, never a read out of bounds.
  for (size_t cut = 1; cut < 64; ++cut) {
    absl::StatusOr<std::vector<ZipRecord>> r =
        ReadZipDirectory(bytes.substr(0, bytes.size() - cut), "x");
    CHECK((!r.ok() || r->size() < records->size()));
  }

  // The data.pkl record's directory entry, rewritten: deflated, claiming 4 GB.
  const ZipRecord* data = Find(*records, "/data.pkl");
  REQUIRE(data != nullptr);
  const std::string entry_name = data->name;
  size_t at = 0;  // its directory entry
  for (size_t p = bytes.find(std::string("PK\x01\x02", 4)); p != std::string::npos;
       p = bytes.find(std::string("PK\x01\x02", 4), p + 1)) {
    if (bytes.compare(p + 46, entry_name.size(), entry_name) == 0) {
      at = p;
      break;
    }
  }
  REQUIRE(at > 0);
  std::string deflated = bytes;
  deflated[at + 10] = 8;
  deflated.replace(at + 24, 4, "\x00\x00\x00\xf0", 4);  // uncompressed: 4026531840 bytes
  CHECK_THAT(Message(ReadZipDirectory(deflated, "x").status()),
             Contains("data.pkl") && Contains("more than"));
  std::string other_method = bytes;
  other_method[at + 10] = 12;  // bzip2
  CHECK_THAT(Message(ReadZipDirectory(other_method, "x").status()),
             Contains("compression method 12"));
  std::string outside = bytes;
  outside.replace(at + 42, 4, "\x00\x00\x00\x7f", 4);  // local header offset
  CHECK_THAT(Message(ReadZipDirectory(outside, "x").status()), Contains("outside the archive"));
}

TEST_CASE("TorchScript code that nests too deeply for the parser is refused", "[graph]") {
  // 8,000 unary minuses overflow TorchScript's parser's stack (a SIGSEGV in torch.jit.load);
  // fuzz/corpus/torchscript_import/deep-unary-code is such an archive.
  const std::string head = "def forward(self, x: Tensor) -> Tensor:\n    return ";
  absl::Status s = CheckTorchScriptCode(head + std::string(8000, '-') + "x\n", "'f.py'");
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(Message(s), Contains("'f.py' nests deeper") && Contains("statement at byte 40"));
  CHECK(!CheckTorchScriptCode(head + std::string(600, '(') + "x" + std::string(600, ')'), "f")
             .ok());
  // Trailing blanks are no indentation.
  CHECK(CheckTorchScriptCode(head + "x" + std::string(600, ' ') + "\n", "f").ok());
  CHECK(!CheckTorchScriptCode("if x:\n" + std::string(600, ' ') + "pass\n", "f").ok());
  // A statement spanning lines inside brackets is one statement.
  std::string spread = head + "f(";
  for (int i = 0; i < 600; ++i) spread += "-x,\n  ";
  CHECK(!CheckTorchScriptCode(spread + ")\n", "f").ok());

  // What real code has: many statements, operators in strings and comments, a few levels each.
  std::string fine = head + "x\n";
  for (int i = 0; i < 2000; ++i) {
    fine += "    _0 = torch.add(torch.neg(-x), (y - 1) * 2, alpha=-1)\n";
  }
  fine += "    s = \"" + std::string(2000, '-') + "\"  # " + std::string(2000, '-') + "\n";
  fine += "    t = 'a\\'" + std::string(2000, '(') + "'\n";
  CHECK(CheckTorchScriptCode(fine, "f").ok());
}

TEST_CASE("an archive LibTorch's reader would fail to open is refused first", "[graph]") {
  // LibTorch's reader leaks ~1.2 KB when its constructor throws after opening the zip (the input
  // fuzz/corpus/torchscript_import/leak-zip-without-records).
  const std::string empty = std::string("PK\x05\x06", 4) + std::string(18, '\0');
  CHECK_THAT(Message(CheckTorchArchive(empty, "x")), Contains("x is not a PyTorch archive") &&
                                                         Contains("no records"));
  const std::string bytes = testing::LoadFixture("mlp").model_bytes;
  auto renamed = [&](const std::string& from, const std::string& to) {
    REQUIRE(from.size() == to.size());
    std::string out = bytes;
    for (size_t p = out.find(from); p != std::string::npos; p = out.find(from, p + 1)) {
      out.replace(p, from.size(), to);
    }
    return out;
  };
  CHECK_THAT(Message(CheckTorchArchive(renamed("mlp/version", "mlp/versi-n"), "x")),
             Contains("no record 'mlp/version'"));
  CHECK_THAT(Message(CheckTorchArchive(renamed("mlp/data/0", "mlp_data_0"), "x")),
             Contains("first record 'mlp_data_0' is not in a directory"));
  absl::StatusOr<std::vector<ZipRecord>> records = ReadZipDirectory(bytes, "x");
  REQUIRE(records.ok());
  const ZipRecord* version = Find(*records, "/version");
  REQUIRE(version != nullptr);
  std::string not_a_number = bytes;
  auto u16 = [&](size_t at) {
    return static_cast<size_t>(static_cast<uint8_t>(bytes[at])) |
           static_cast<size_t>(static_cast<uint8_t>(bytes[at + 1])) << 8;
  };
  const size_t text = version->offset + 30 + u16(version->offset + 26) +
                      u16(version->offset + 28);  // past its local header
  REQUIRE(not_a_number.compare(text, 2, "3\n") == 0);
  not_a_number[text] = 'x';
  CHECK_THAT(Message(CheckTorchArchive(not_a_number, "x")),
             Contains("'mlp/version' holds no version number"));
}

TEST_CASE("a class constant without a type annotation is refused", "[graph]") {
  // LibTorch 1.13 reads the absent annotation (fuzz/corpus/torchscript_import/
  // class-constant-without-type: `__buffers__` with one bit flipped crashed torch.jit.load).
  const std::string head = "class M(Module):\n  __parameters__ = []\n";
  absl::Status s = CheckTorchScriptCode(head + "  __muffers__ = []\n", "'m.py'");
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(Message(s), Contains("'m.py': the class constant '__muffers__'"));
  CHECK(!CheckTorchScriptCode(head + "  training : bool; foo = 3\n", "f").ok());
  CHECK(!CheckTorchScriptCode("class M(Module): foo = 3\n", "f").ok());
  CHECK(!CheckTorchScriptCode("class M:\n  # a comment\n\n  foo=(1,\n    2)\n", "f").ok());

  // What torch.jit.save writes, and assignments that are not a class's constants.
  CHECK(CheckTorchScriptCode(head + "  __buffers__ = [\"running_mean\", ]\n"
                                    "  training : bool\n"
                                    "  __annotations__[\"0\"] = __torch__.Linear\n"
                                    "  k : Final[int] = 3\n"
                                    "  def forward(self: __torch__.M,\n    x: Tensor) -> Tensor:\n"
                                    "    y = torch.relu(x)\n"
                                    "    return y\n"
                                    "x = 3\n"
                                    "class C(Enum):\n  RED = 1\n  GREEN = 2\n",
                             "f")
            .ok());
}

TEST_CASE("debug information whose ranges leave their texts is refused", "[graph]") {
  // TorchScript maps source ranges through it unchecked; fuzz/corpus/torchscript_import/
  // debug-pkl-text-index crashed an error message's formatting (SourceRange::highlight).
  auto debug = [](std::vector<int64_t> texts, int64_t file, int64_t start, int64_t end) {
    c10::IValue source = c10::ivalue::Tuple::create(
        {c10::IValue(c10::List<int64_t>(texts)), c10::IValue(file), c10::IValue(int64_t{1})});
    c10::IValue range = c10::ivalue::Tuple::create({source, c10::IValue(start), c10::IValue(end)});
    // As torch.jit.save writes it: ("FORMAT_WITH_STRING_TABLE", texts, ranges).
    c10::IValue table = c10::ivalue::Tuple::create(
        {c10::IValue(std::string("def f(x):")), c10::IValue(std::string("  return x")),
         c10::IValue(std::string("m.py"))});
    c10::IValue record =
        c10::ivalue::Tuple::create({c10::IValue(int64_t{0}), range, c10::IValue(int64_t{0})});
    const std::vector<char> bytes = torch::jit::pickle(
        c10::ivalue::Tuple::create({c10::IValue(std::string("FORMAT_WITH_STRING_TABLE")), table,
                                    c10::ivalue::Tuple::create({record})}),
        nullptr);
    return std::string(bytes.begin(), bytes.end());
  };
  const std::string good = debug({0, 1}, 2, 4, 19);  // 19: both texts' length
  REQUIRE(CheckPickle(good, "d").ok());
  CHECK(CheckDebugInfo(good, "d").ok());
  CHECK_THAT(Message(CheckDebugInfo(debug({0, 7}, 2, 0, 1), "'d'")),
             Contains("'d' is not TorchScript's debug information") &&
                 Contains("names text 7 of 3"));
  CHECK_THAT(Message(CheckDebugInfo(debug({0}, 3, 0, 1), "d")), Contains("names text 3 of 3"));
  CHECK_THAT(Message(CheckDebugInfo(debug({0, 1}, 2, 4, 21), "d")),
             Contains("[4, 21) lies outside its source's 19 bytes"));
  CHECK(CheckDebugInfo(debug({0, 1}, 2, 19, 20), "d").ok());  // one past: as torch writes
  CHECK(!CheckDebugInfo(debug({0, 1}, 2, 20, 20), "d").ok());
  CHECK(!CheckDebugInfo(debug({0}, 2, 5, 4), "d").ok());
  CHECK(!CheckDebugInfo(debug({-1}, 2, 0, 0), "d").ok());
  CHECK_THAT(Message(CheckDebugInfo(std::string("\x80\x02K\x01.", 5), "d")),
             Contains("not a tuple"));
}

TEST_CASE("a type annotation that is no type is refused", "[graph]") {
  // TorchScript's type parser crashes on some (fuzz/corpus/torchscript_import/
  // annotation-string-subscript: `__parameters__ :n["weight", "bias", ]`, a SIGSEGV).
  absl::Status s = CheckTorchScriptCode(
      "class M(Module):\n  __parameters__ :n[\"weight\", \"bias\", ]\n", "'m.py'");
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(Message(s), Contains("'m.py': the type annotation 'n[\"weight\", \"bias\", ]'") &&
                             Contains("is not a type"));
  CHECK(!CheckTorchScriptCode("def f(x: List[\"a\"]) -> Tensor:\n  return x\n", "f").ok());
  CHECK(!CheckTorchScriptCode("def f(x: Tensor) -> f(1 + 2):\n  return x\n", "f").ok());
  CHECK(!CheckTorchScriptCode("def f(x):\n  y : Optional[3 - 1] = None\n", "f").ok());

  // What torch.jit.save writes.
  CHECK(CheckTorchScriptCode(
            "class M(Module):\n"
            "  __parameters__ = [\"w\", ]\n"
            "  _is_full_backward_hook : Optional[bool]\n"
            "  fc : __torch__.torch.nn.modules.linear.___torch_mangle_0.Linear\n"
            "  k : Final[int] = 3\n"
            "  def forward(self: __torch__.M,\n    a: Tensor,\n    b: Tuple[()]) -> "
            "Tuple[Tensor, Tuple[Tensor, Tensor]]:\n"
            "    _0 : List[Tensor] = []\n"
            "    if torch.eq(a, b):\n      pass\n    else:\n      pass\n"
            "    d = {\"a\": a}\n"
            "    return (a, (b, a))\n"
            "  def g(self: __torch__.M, x: int=3) -> None:\n    return None\n",
            "f")
            .ok());
}

}  // namespace
}  // namespace rannc
