#include "daemon/common/torch_archive.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <memory>

#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "daemon/common/status.h"

namespace rannc {

namespace {

// Little-endian reads; callers check the bounds first.
uint64_t Le(absl::string_view b, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(b[at + i]);
  return v;
}

constexpr uint32_t kEndOfDirectory = 0x06054b50;
constexpr uint32_t kZip64Locator = 0x07064b50;
constexpr uint32_t kZip64EndOfDirectory = 0x06064b50;
constexpr uint32_t kDirectoryEntry = 0x02014b50;
constexpr uint32_t kLocalHeader = 0x04034b50;
constexpr size_t kEndSize = 22;
constexpr size_t kEntrySize = 46;
constexpr size_t kLocalSize = 30;
constexpr uint64_t kMax32 = 0xFFFFFFFF;
// Deflate produces at most ~1032 bytes per compressed byte.
constexpr uint64_t kMaxDeflateRatio = 1032;

absl::Status NotZip(absl::string_view what, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat(what, " is not a valid zip: ", why));
}

// The zip64 extended sizes of a directory entry, where its 32-bit fields say so.
absl::Status ReadZip64Extra(absl::string_view extra, absl::string_view what,
                            const std::string& name, uint64_t* size, uint64_t* compressed,
                            uint64_t* offset) {
  size_t p = 0;
  while (extra.size() - p >= 4) {
    const uint64_t id = Le(extra, p, 2);
    const uint64_t len = Le(extra, p + 2, 2);
    p += 4;
    if (len > extra.size() - p) break;
    if (id == 1) {
      size_t q = p;
      for (uint64_t* field : {size, compressed, offset}) {
        if (*field != kMax32) continue;
        if (q + 8 > p + len) {
          return NotZip(what, absl::StrCat("record '", name, "': short zip64 field"));
        }
        *field = Le(extra, q, 8);
        q += 8;
      }
      return absl::OkStatus();
    }
    p += len;
  }
  return NotZip(what, absl::StrCat("record '", name,
                                   "' has 32-bit sizes of 0xFFFFFFFF and no zip64 field"));
}

// A deflated pickle's or code file's stated size: far above any real one (kilobytes to
// megabytes), and what LibTorch's reader allocates before inflating it.
constexpr uint64_t kMaxInflated = uint64_t{256} << 20;

// LibTorch's zip reader over bytes it does not own.
class ViewReader : public caffe2::serialize::ReadAdapterInterface {
 public:
  explicit ViewReader(absl::string_view bytes) : bytes_(bytes) {}
  size_t size() const override { return bytes_.size(); }
  size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/) const override {
    if (pos >= bytes_.size()) return 0;
    n = std::min<size_t>(n, bytes_.size() - pos);
    std::memcpy(buf, bytes_.data() + pos, n);
    return n;
  }

 private:
  absl::string_view bytes_;
};

bool IsCode(const std::string& name) {
  return absl::EndsWith(name, ".py");
}

bool IsPickle(const std::string& name) {
  return absl::EndsWith(name, ".pkl") || absl::EndsWith(name, "debug_pkl");
}

}  // namespace

absl::StatusOr<std::vector<ZipRecord>> ReadZipDirectory(absl::string_view b,
                                                        absl::string_view what) {
  if (b.size() < kEndSize) return NotZip(what, absl::StrCat("it has ", b.size(), " bytes"));
  // The end-of-directory record: the last 22 bytes, or earlier by a comment of up to 64 KiB.
  size_t end = absl::string_view::npos;
  for (size_t i = b.size() - kEndSize;; --i) {
    if (Le(b, i, 4) == kEndOfDirectory) {
      end = i;
      break;
    }
    if (i == 0 || b.size() - i >= kEndSize + 0xFFFF) break;
  }
  if (end == absl::string_view::npos) return NotZip(what, "no end-of-directory record");
  uint64_t count = Le(b, end + 10, 2);
  uint64_t dir_size = Le(b, end + 12, 4);
  uint64_t dir_offset = Le(b, end + 16, 4);
  if (count == 0xFFFF || dir_size == kMax32 || dir_offset == kMax32) {
    if (end < 20 || Le(b, end - 20, 4) != kZip64Locator) return NotZip(what, "no zip64 locator");
    const uint64_t at = Le(b, end - 20 + 8, 8);
    if (at > b.size() || b.size() - at < 56 || Le(b, at, 4) != kZip64EndOfDirectory) {
      return NotZip(what, "the zip64 end-of-directory record is not where its locator says");
    }
    count = Le(b, at + 32, 8);
    dir_size = Le(b, at + 40, 8);
    dir_offset = Le(b, at + 48, 8);
  }
  if (dir_offset > b.size() || dir_size > b.size() - dir_offset) {
    return NotZip(what, "the central directory lies outside the archive");
  }
  if (count > dir_size / kEntrySize) {
    return NotZip(what, absl::StrCat(count, " records cannot fit a directory of ", dir_size,
                                     " bytes"));
  }
  std::vector<ZipRecord> out;
  out.reserve(count);
  const size_t dir_end = dir_offset + dir_size;
  size_t p = dir_offset;
  for (uint64_t i = 0; i < count; ++i) {
    if (dir_end - p < kEntrySize || Le(b, p, 4) != kDirectoryEntry) {
      return NotZip(what, absl::StrCat("directory entry ", i, " is malformed"));
    }
    const size_t name_len = Le(b, p + 28, 2);
    const size_t extra_len = Le(b, p + 30, 2);
    const size_t comment_len = Le(b, p + 32, 2);
    if (dir_end - p - kEntrySize < name_len + extra_len + comment_len) {
      return NotZip(what, absl::StrCat("directory entry ", i, " runs past the directory"));
    }
    ZipRecord r;
    r.name = std::string(b.substr(p + kEntrySize, name_len));
    r.method = static_cast<uint16_t>(Le(b, p + 10, 2));
    r.compressed = Le(b, p + 20, 4);
    r.size = Le(b, p + 24, 4);
    r.offset = Le(b, p + 42, 4);
    if (r.size == kMax32 || r.compressed == kMax32 || r.offset == kMax32) {
      absl::Status wide = ReadZip64Extra(b.substr(p + kEntrySize + name_len, extra_len), what,
                                         r.name, &r.size, &r.compressed, &r.offset);
      if (!wide.ok()) return wide;
    }
    const std::string record = absl::StrCat("record '", r.name, "'");
    if (r.method != 0 && r.method != 8) {
      return NotZip(what, absl::StrCat(record, " uses compression method ", r.method,
                                       " (torch.jit.save stores its records)"));
    }
    if (r.method == 0 && r.size != r.compressed) {
      return NotZip(what, absl::StrCat(record, " is stored but states ", r.size,
                                       " bytes uncompressed and ", r.compressed, " compressed"));
    }
    if (r.method == 8 && r.size / kMaxDeflateRatio > r.compressed) {
      return NotZip(what, absl::StrCat(record, " states ", r.size,
                                       " bytes uncompressed, more than ", r.compressed,
                                       " deflated bytes can hold"));
    }
    if (r.offset > b.size() || r.compressed > b.size() - r.offset) {
      return NotZip(what, absl::StrCat(record, " lies outside the archive"));
    }
    out.push_back(std::move(r));
    p += kEntrySize + name_len + extra_len + comment_len;
  }
  return out;
}

namespace {

// What a pickle opcode does to the pickle machine's stack: it needs `need` items above the last
// mark, takes `pop` and puts `push`; or it sets a mark (kSet), or takes everything above the last
// mark and the mark (kTake), needing `need` items below the mark (APPENDS: the list) or above it
// (OBJ: the class, `above`).
struct StackEffect {
  enum Mark { kNone, kSet, kTake } mark = kNone;
  int need = 0;
  int pop = 0;
  int push = 0;
  bool above = false;
};

StackEffect EffectOf(char op) {
  StackEffect e;
  auto fixed = [&](int need, int pop, int push) {
    e.need = need;
    e.pop = pop;
    e.push = push;
  };
  auto take = [&](int need, int push, bool above = false) {
    e.mark = StackEffect::kTake;
    e.need = need;
    e.push = push;
    e.above = above;
  };
  switch (op) {
    case '(': e.mark = StackEffect::kSet; break;                  // MARK
    case '1': take(0, 0); break;                                   // POP_MARK
    case 'e': case 'u': case '\x90': take(1, 0); break;           // APPENDS SETITEMS ADDITEMS
    case 'l': case 't': case 'd': case '\x91': case 'i': take(0, 1); break;  // LIST TUPLE ...
    case 'o': take(1, 1, /*above=*/true); break;                   // OBJ
    case '.': fixed(1, 0, 0); break;                               // STOP
    case '\x80': case '\x95': break;                               // PROTO FRAME
    case 'p': case 'q': case 'r': case '\x94': case '\x98': fixed(1, 0, 0); break;  // PUTs
    case 'Q': case '\x85': fixed(1, 1, 1); break;                  // BINPERSID TUPLE1
    case '2': fixed(1, 0, 1); break;                               // DUP
    case '0': fixed(1, 1, 0); break;                               // POP
    case 'a': fixed(2, 1, 0); break;                               // APPEND
    case '\x86': case 'R': case 'b': case '\x81': case '\x93': fixed(2, 2, 1); break;
    case '\x87': case '\x92': fixed(3, 3, 1); break;                // TUPLE3 NEWOBJ_EX
    case 's': fixed(3, 2, 0); break;                               // SETITEM
    default: fixed(0, 0, 1); break;                                // the rest push one
  }
  return e;
}

}  // namespace

absl::Status CheckPickle(absl::string_view data, absl::string_view what) {
  size_t pos = 0;
  uint64_t puts = 0;  // memo entries so far (a pickler numbers them 0, 1, ...)
  // The stack as a count and the marks' depths: LibTorch 1.13's unpickler does not check that
  // an opcode has the items it takes (a bad free in it, found by the fuzzer).
  uint64_t depth = 0;
  std::vector<uint64_t> marks;
  auto fail = [&](size_t at, const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " is not a valid pickle: ", why, " at byte ", at));
  };
  auto remaining = [&] { return data.size() - pos; };
  while (pos < data.size()) {
    const size_t at = pos;
    const char op = data[pos++];
    // Fixed-size arguments, lengths before their bytes, and newline-ended arguments.
    int fixed = 0;
    int length_bytes = 0;
    bool signed_length = false;
    int lines = 0;
    enum { kNone, kPut, kGet } memo = kNone;
    // The stack first (every opcode the switch below lets through is known to EffectOf).
    const StackEffect effect = EffectOf(op);
    const uint64_t base = marks.empty() ? 0 : marks.back();
    if (effect.mark == StackEffect::kSet) {
      marks.push_back(depth);
    } else if (effect.mark == StackEffect::kTake) {
      if (marks.empty()) return fail(at, "an opcode that takes a mark where none is set");
      const uint64_t mark = marks.back();
      marks.pop_back();
      const uint64_t below = mark - (marks.empty() ? 0 : marks.back());
      if ((effect.above ? depth - mark : below) < static_cast<uint64_t>(effect.need)) {
        return fail(at, "an opcode that takes more of the stack than there is");
      }
      depth = mark + effect.push;
    } else {
      if (depth - base < static_cast<uint64_t>(effect.need)) {
        return fail(at, absl::StrCat("an opcode that takes ", effect.need, " of the stack's ",
                                     depth - base, " items (above its last mark)"));
      }
      depth = depth - effect.pop + effect.push;
    }
    switch (op) {
      case '.':  // STOP
        return absl::OkStatus();
      case '(': case '0': case '1': case '2': case 'N': case ']': case 'a': case 'e':
      case 'l': case ')': case 't': case '}': case 'd': case 's': case 'u': case 'b':
      case 'R': case 'o': case 'Q':
      case '\x81': case '\x85': case '\x86': case '\x87': case '\x88': case '\x89':
      case '\x8f': case '\x90': case '\x91': case '\x92': case '\x93': case '\x97':
      case '\x98':
        break;
      case '\x94':  // MEMOIZE
        ++puts;
        break;
      case '\x80': case 'K': case '\x82': fixed = 1; break;  // PROTO BININT1 EXT1
      case 'M': case '\x83': fixed = 2; break;               // BININT2 EXT2
      case 'J': case '\x84': fixed = 4; break;               // BININT EXT4
      case 'G': case '\x95': fixed = 8; break;               // BINFLOAT FRAME
      case 'h': fixed = 1; memo = kGet; break;               // BINGET
      case 'j': fixed = 4; memo = kGet; break;               // LONG_BINGET
      case 'q': fixed = 1; memo = kPut; break;               // BINPUT
      case 'r': fixed = 4; memo = kPut; break;               // LONG_BINPUT
      case 'U': case 'C': case '\x8c': case '\x8a':          // SHORT_BINSTRING SHORT_BINBYTES
        length_bytes = 1;                                    // SHORT_BINUNICODE LONG1
        break;
      case 'T': case '\x8b':  // BINSTRING LONG4
        length_bytes = 4;
        signed_length = true;
        break;
      case 'X': case 'B': length_bytes = 4; break;                   // BINUNICODE BINBYTES
      case '\x8d': case '\x8e': case '\x96': length_bytes = 8; break;  // the 8-byte ones
      case 'I': case 'L': case 'F': case 'S': case 'V': case 'P': lines = 1; break;
      case 'g': lines = 1; memo = kGet; break;  // GET
      case 'p': lines = 1; memo = kPut; break;  // PUT
      case 'c': case 'i': lines = 2; break;     // GLOBAL INST
      default:
        return fail(at, absl::StrFormat("unknown opcode 0x%02x",
                                        static_cast<unsigned>(static_cast<uint8_t>(op))));
    }
    uint64_t index = 0;
    if (fixed > 0) {
      if (remaining() < static_cast<size_t>(fixed)) return fail(at, "a truncated argument");
      if (op == '\x95' && Le(data, pos, 8) > remaining() - 8) {
        return fail(at, absl::StrCat("a frame of ", Le(data, pos, 8), " bytes where ",
                                     remaining() - 8, " remain"));
      }
      index = Le(data, pos, fixed);
      pos += fixed;
    }
    if (length_bytes > 0) {
      if (remaining() < static_cast<size_t>(length_bytes)) return fail(at, "a truncated length");
      uint64_t length = Le(data, pos, length_bytes);
      if (signed_length && (length & 0x80000000u)) return fail(at, "a negative length");
      pos += length_bytes;
      if (length > remaining()) {
        return fail(at, absl::StrCat("a length of ", length, " bytes where ", remaining(),
                                     " remain"));
      }
      pos += length;
    }
    for (int line = 0; line < lines; ++line) {
      const size_t newline = data.find('\n', pos);
      if (newline == absl::string_view::npos) return fail(at, "an unterminated argument");
      if (memo != kNone && !absl::SimpleAtoi(data.substr(pos, newline - pos), &index)) {
        return fail(at, "a memo index that is not a number");
      }
      pos = newline + 1;
    }
    if (memo == kPut) {
      if (index > puts) {
        return fail(at, absl::StrCat("memo index ", index, " after ", puts, " entries"));
      }
      if (index == puts) ++puts;
    } else if (memo == kGet && index >= puts) {
      return fail(at, absl::StrCat("memo index ", index, " of ", puts, " entries"));
    }
  }
  return fail(pos, "no STOP opcode");
}

namespace {

// CheckDebugInfo, but for exceptions.
absl::Status CheckDebugValue(absl::string_view pickle, absl::string_view what) {
  c10::IValue root;
  try {
    root = torch::jit::unpickle(pickle.data(), pickle.size());
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " does not unpickle: ", FirstLine(e.what())));
  }
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " is not TorchScript's debug information: ", why));
  };
  // Element by element: a list typed as ints may hold anything (build_intlist of a mutated
  // pickle), and toIntVector would throw.
  auto ints = [](const c10::IValue& v, std::vector<int64_t>* out) {
    if (!v.isList()) return false;
    for (const c10::IValue& i : v.toListRef()) {
      if (!i.isInt()) return false;
      out->push_back(i.toInt());
    }
    return true;
  };
  // A tuple's or a list's elements.
  auto elements = [](const c10::IValue& v, std::vector<c10::IValue>* out) {
    if (v.isTuple()) {
      *out = v.toTupleRef().elements().vec();
    } else if (v.isList()) {
      *out = v.toListRef().vec();
    } else {
      return false;
    }
    return true;
  };
  // ("FORMAT_WITH_STRING_TABLE", texts, ranges), or the ranges alone.
  std::vector<c10::IValue> records;
  if (!elements(root, &records)) return bad("not a tuple");
  std::vector<int64_t> table;  // each text's length
  bool with_table = false;
  if (records.size() == 3 && records[0].isString() &&
      records[0].toStringRef() == "FORMAT_WITH_STRING_TABLE") {
    std::vector<c10::IValue> texts;
    if (!elements(records[1], &texts)) return bad("its string table is not a tuple");
    for (const c10::IValue& s : texts) {
      if (!s.isString()) return bad("its string table holds a non-string");
      table.push_back(static_cast<int64_t>(s.toStringRef().size()));
    }
    with_table = true;
    std::vector<c10::IValue> ranges;
    if (!elements(records[2], &ranges)) return bad("its ranges are not a tuple");
    records = std::move(ranges);
  }
  // (byte offset in the code, (source, start, end)[, tag]) per range, each source (text
  // indices, file name index, first line) with the table, else (text, file name, line).
  for (size_t r = 0; r < records.size(); ++r) {
    const std::string which = absl::StrCat("range ", r);
    if (!records[r].isTuple()) return bad(which + " is not a tuple");
    const auto& record = records[r].toTupleRef().elements();
    if ((record.size() != 2 && record.size() != 3) || !record[0].isInt() || !record[1].isTuple() ||
        (record.size() == 3 && !record[2].isInt())) {
      return bad(which + " is malformed");
    }
    const auto& range = record[1].toTupleRef().elements();
    if (range.size() != 3 || !range[0].isTuple() || !range[1].isInt() || !range[2].isInt()) {
      return bad(which + " is malformed");
    }
    const auto& source = range[0].toTupleRef().elements();
    if (source.size() != 3 || !source[2].isInt()) return bad(which + "'s source is malformed");
    int64_t length = 0;
    if (with_table) {
      std::vector<int64_t> texts;
      if (!ints(source[0], &texts) || !source[1].isInt()) {
        return bad(which + "'s source is malformed");
      }
      texts.push_back(source[1].toInt());  // the file name's index too
      for (size_t t = 0; t < texts.size(); ++t) {
        if (texts[t] < 0 || texts[t] >= static_cast<int64_t>(table.size())) {
          return bad(absl::StrCat(which, "'s source names text ", texts[t], " of ",
                                  table.size()));
        }
        if (t + 1 < texts.size()) length += table[texts[t]];
      }
    } else {
      if (!source[0].isString() || !(source[1].isNone() || source[1].isString())) {
        return bad(which + "'s source is malformed");
      }
      length = static_cast<int64_t>(source[0].toStringRef().size());
    }
    const int64_t start = range[1].toInt();
    const int64_t end = range[2].toInt();
    // One past the text is what torch.jit.save writes for a range of no source ([0, 1) of an
    // empty text: 30 of a traced TransformerEncoder's 369).
    if (start < 0 || start > end || start > length || end > length + 1) {
      return bad(absl::StrCat(which, " [", start, ", ", end, ") lies outside its source's ",
                              length, " bytes"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckDebugInfo(absl::string_view pickle, absl::string_view what) {
  try {
    return CheckDebugValue(pickle, what);
  } catch (const std::exception& e) {  // an accessor's check: no path should reach one
    return absl::InvalidArgumentError(absl::StrCat(
        what, " is not TorchScript's debug information: ", FirstLine(e.what())));
  }
}

namespace {

// A stored record's bytes, after its local header.
absl::StatusOr<absl::string_view> Stored(absl::string_view bytes, const ZipRecord& r,
                                         absl::string_view what) {
  const uint64_t at = r.offset;
  if (bytes.size() - at < kLocalSize || Le(bytes, at, 4) != kLocalHeader) {
    return NotZip(what, absl::StrCat("record '", r.name, "' has no local header where the "
                                     "directory says"));
  }
  const uint64_t data = at + kLocalSize + Le(bytes, at + 26, 2) + Le(bytes, at + 28, 2);
  if (data > bytes.size() || r.size > bytes.size() - data) {
    return NotZip(what, absl::StrCat("record '", r.name, "' runs past the archive"));
  }
  return bytes.substr(data, r.size);
}

// What LibTorch's reader needs of an archive's layout before its constructor finishes (when it
// throws after opening the zip, miniz's reader state leaks, ~1.2 KB each time): records, the
// first in a directory, and a version record in it whose text is a number.
absl::Status CheckLayout(absl::string_view bytes, const std::vector<ZipRecord>& records,
                         absl::string_view what) {
  auto not_pytorch = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is not a PyTorch archive: ", why));
  };
  if (records.empty()) return not_pytorch("it holds no records");
  const std::string& first = records[0].name;
  const size_t slash = first.find('/');
  if (slash == std::string::npos) {
    return not_pytorch(absl::StrCat("its first record '", first, "' is not in a directory"));
  }
  const std::string top = first.substr(0, slash + 1);
  const ZipRecord* version = nullptr;
  for (const char* name : {".data/version", "version"}) {  // LibTorch's order
    for (const ZipRecord& r : records) {
      if (version == nullptr && r.name == top + name) version = &r;
    }
  }
  if (version == nullptr) {
    return not_pytorch(absl::StrCat("it has no record '", top, "version'"));
  }
  if (version->method != 0) return absl::OkStatus();  // LibTorch reads it (never so written)
  absl::StatusOr<absl::string_view> text = Stored(bytes, *version, what);
  if (!text.ok()) return text.status();
  const absl::string_view number = absl::StripAsciiWhitespace(*text);
  if (number.empty() || number.size() > 18 ||
      !std::all_of(number.begin(), number.end(), absl::ascii_isdigit)) {
    return not_pytorch(absl::StrCat("its record '", version->name, "' holds no version number"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckTorchArchive(absl::string_view bytes, absl::string_view what) {
  absl::StatusOr<std::vector<ZipRecord>> records = ReadZipDirectory(bytes, what);
  if (!records.ok()) return records.status();
  if (absl::Status layout = CheckLayout(bytes, *records, what); !layout.ok()) return layout;
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> reader;  // for deflated records
  for (const ZipRecord& r : *records) {
    const bool pickle = IsPickle(r.name);
    const bool code = IsCode(r.name);
    if (!pickle && !code) continue;
    const std::string record = absl::StrCat(what, "'s ", pickle ? "pickle" : "code", " '",
                                            r.name, "'");
    absl::string_view contents;
    std::string inflated;
    if (r.method == 0) {
      absl::StatusOr<absl::string_view> stored = Stored(bytes, r, what);
      if (!stored.ok()) return stored.status();
      contents = *stored;
    } else {
      // Deflated (torch.jit.save compresses its code and the code's debug_pkl files): inflated
      // by LibTorch's own reader, which allocates the stated size first.
      if (r.size > kMaxInflated) {
        return absl::InvalidArgumentError(absl::StrCat(
            record, " states ", r.size, " bytes uncompressed; at most ", kMaxInflated,
            " are accepted"));
      }
      try {
        if (!reader) {
          reader = std::make_unique<caffe2::serialize::PyTorchStreamReader>(
              std::make_shared<ViewReader>(bytes));
        }
        // The reader names records without the archive's top directory.
        const size_t slash = r.name.find('/');
        auto [data, size] =
            reader->getRecord(slash == std::string::npos ? r.name : r.name.substr(slash + 1));
        inflated.assign(static_cast<const char*>(data.get()), size);
      } catch (const std::exception& e) {
        return NotZip(what, absl::StrCat("record '", r.name, "' does not inflate: ",
                                         FirstLine(e.what())));
      }
      contents = inflated;
    }
    absl::Status ok = pickle ? CheckPickle(contents, record) : CheckTorchScriptCode(contents,
                                                                                     record);
    if (ok.ok() && absl::EndsWith(r.name, ".debug_pkl")) ok = CheckDebugInfo(contents, record);
    if (!ok.ok()) return ok;
  }
  return absl::OkStatus();
}

}  // namespace rannc
