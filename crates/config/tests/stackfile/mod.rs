//! Stack files from a seed, and the driver that runs one through `cairn check`'s code path.
//!
//! Shared by the property test (`../stack_fuzz.rs`, on stable in `cargo test`) and the
//! fuzz target (`../../fuzz/fuzz_targets/stack_file.rs`), so that both run exactly the
//! same checks.
//!
//! [`generate`] writes a stack file from a seed: a few devices of every type (and of
//! types that do not exist), keys with good and bad values (zero, huge, negative, of the
//! wrong type, unicode), members that form trees, cycles and chains deeper than allowed,
//! unicode and control-character names, files named twice under other spellings, and
//! now and then a corrupted text (cut short, a byte changed, a line repeated).
//!
//! [`drive`] parses the text, points every file device into a scratch directory (nothing
//! outside it is ever created or changed) and does what `cairn check` does: opens every
//! top-level device and prints the trees. It panics when a rule is broken: a refusal that
//! is not one line, or that names neither a device nor the file's part at fault.
#![allow(dead_code)]

use std::path::Path;

use cairn_config::{DeviceSpec, StackFile};
use cairn_core::Switches;
use cairn_leaves::LeafSpec;

/// What happened to one stack file.
#[derive(Debug)]
pub enum Outcome {
    /// Checked: the text `cairn check` would print.
    Checked(String),
    /// Refused with this message.
    Refused(String),
}

/// Runs `text` through `cairn check`'s code path with file devices inside `dir`, and
/// checks the rules of a refusal.
pub fn drive(text: &str, dir: &Path) -> Outcome {
    let outcome = match StackFile::parse(text) {
        Err(e) => Outcome::Refused(e.to_string()),
        Ok(mut file) => {
            confine(&mut file, dir);
            let switches = file.tuning.over(Switches::default());
            match file.check(None, switches) {
                Ok(report) => Outcome::Checked(report),
                Err(e) => Outcome::Refused(e.to_string()),
            }
        }
    };
    if let Outcome::Refused(message) = &outcome {
        check_refusal(message);
    }
    outcome
}

/// Markers of a message that names what is at fault: a device or an export (quoted), a
/// table of the file, or the file itself.
const NAMES: [&str; 13] = [
    "device '",
    "devices form a cycle",
    "devices '",
    "export '",
    "exports '",
    "device name '",
    "export name '",
    "writeback:",
    "tuning:",
    "the stack file",
    "not valid TOML",
    "top-level key",
    "must be a table",
];

/// A refusal is one line that names what is at fault.
pub fn check_refusal(message: &str) {
    assert!(!message.trim().is_empty(), "an empty refusal");
    assert!(
        !message.contains('\n') && !message.contains('\r'),
        "a refusal of more than one line: {message:?}"
    );
    assert!(
        NAMES.iter().any(|n| message.contains(n)),
        "a refusal that names no device, export, table or the file: {message:?}"
    );
}

/// Points every file device at a file inside `dir`, keeping which devices share a path.
fn confine(file: &mut StackFile, dir: &Path) {
    for spec in file.devices.values_mut() {
        if let DeviceSpec::Leaf(LeafSpec::File { path, .. }) = spec {
            // The name keeps a path's spelling apart from others (so "a" twice stays one
            // file, and "a" and "b" two), as a flat, safe file name.
            let flat: String = path
                .to_string_lossy()
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                .take(64)
                .collect();
            *path = dir.join(format!("f{flat}"));
        }
    }
}

/// A small deterministic generator (xorshift64*), so a failing case is its seed.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A number below `n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// True with probability `percent` in 100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// A TOML basic string: quotes, backslashes and control characters escaped.
fn quoted(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out += "\\\"",
            '\\' => out += "\\\\",
            c if c.is_control() => out += &format!("\\u{:04X}", c as u32),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Values of one kind of key: good ones, and bad ones (out of range, of the wrong type,
/// not a value at all).
struct Pool {
    good: &'static [&'static str],
    bad: &'static [&'static str],
}

const TYPES: Pool = Pool {
    good: &[
        "null", "mem", "file", "linear", "stripe", "mirror", "raid10", "fault", "delay", "cache",
    ],
    bad: &["raid5", "", "NULL", "mém"],
};
const SIZES: Pool = Pool {
    good: &[
        "\"1M\"", "\"4M\"", "\"64K\"", "1048576", "\"2M\"", "\"16M\"",
    ],
    bad: &[
        "\"0\"",
        "0",
        "-1",
        "\"-4k\"",
        "\"1.5G\"",
        "1.5",
        "\"100T\"",
        "\"99999999999999999999\"",
        "9223372036854775807",
        "\"16E\"",
        "\"8P\"",
        "\"1x\"",
        "\"\"",
        "true",
        "[1]",
        "{ a = 1 }",
        "\"1000\"",
        "\"513\"",
        "\"١٢٣\"",
        "nan",
        "inf",
        "1979-05-27T07:32:00Z",
    ],
};
const MEMORY: Pool = Pool {
    good: &["\"1M\"", "\"64K\"", "\"4M\""],
    bad: &["\"0\"", "\"63K\"", "\"100T\"", "\"1E\"", "-1", "\"lots\""],
};
const BANDWIDTH: Pool = Pool {
    // Not the edge of the range (1M, tested in stack_bounds.rs): an array with metadata
    // opened on a blank member reads its metadata area and up to 64 MiB that the member's
    // allocation map shows allocated (through a cache holding pages, all of it), so a
    // chain of arrays over 1 MB/s delays would take minutes to check.
    good: &["\"150M\"", "\"16M\"", "\"1G\""],
    bad: &["\"0\"", "0", "\"1\"", "\"1023K\"", "\"fast\""],
};
const DURATIONS: Pool = Pool {
    // Short: arrays with metadata read and write their superblocks through these when
    // they open, and a chain of 10 s latencies would make a check take minutes (the
    // edge of the range is tested in stack_bounds.rs).
    good: &["\"1ms\"", "\"0\"", "\"250us\"", "\"2.5ms\""],
    bad: &[
        "\"1h\"",
        "\"-1s\"",
        "\"1e308s\"",
        "\"nan\"",
        "5",
        "\"ms\"",
        "1e300",
        "\"11s\"",
        "\"10.000000001s\"",
        "\"99999999999999999999999d\"",
    ],
};
const AFTER_SECS: Pool = Pool {
    good: &["0", "1.5", "\"2s\"", "3600"],
    bad: &["-1", "1e300", "\"400d\"", "inf", "nan", "\"soon\""],
};
const BLOCKS: Pool = Pool {
    good: &["\"512\"", "\"4k\"", "4096"],
    bad: &["\"128K\"", "\"1000\"", "\"256\"", "0", "\"8G\"", "\"64Q\""],
};
const CHUNKS: Pool = Pool {
    good: &["\"64K\"", "\"4K\"", "\"1M\"", "\"512K\""],
    bad: &["\"256\"", "\"2G\"", "\"48K\"", "0", "\"0\"", "3.5"],
};
const BOOLS: Pool = Pool {
    good: &["true", "false", "1", "0"],
    bad: &["2", "\"yes\""],
};
const COPIES: Pool = Pool {
    good: &["2", "3"],
    bad: &[
        "0",
        "1",
        "33",
        "-2",
        "18446744073709551615",
        "2.5",
        "\"two\"",
    ],
};
const FAIL: Pool = Pool {
    good: &[
        "[\"write\"]",
        "[\"read\", \"flush\"]",
        "[\"discard\", \"write-zeroes\"]",
    ],
    bad: &["[]", "\"write\"", "[\"erase\"]", "[1]"],
};
const PROBABILITY: Pool = Pool {
    good: &["0.5", "1", "0"],
    bad: &["2", "-0.1", "nan", "\"half\""],
};
const SECTORS: Pool = Pool {
    good: &["[0, 8]", "[100, 200]"],
    bad: &["[8, 0]", "[0]", "[-1, 4]", "[0, 1, 2]", "\"0-8\""],
};
const ERRNO: Pool = Pool {
    good: &["\"EIO\"", "\"ENOSPC\"", "28"],
    bad: &["\"EFOO\"", "0", "5000", "-5"],
};
const ENGINES: Pool = Pool {
    good: &["\"auto\"", "\"io_uring\"", "\"aio\"", "\"sync\""],
    bad: &["\"spdk\"", "1"],
};
const METADATA: Pool = Pool {
    good: &["\"1\"", "\"none\""],
    bad: &["\"2\"", "1", "true"],
};
const TUNING: [(&str, Pool); 6] = [
    (
        "clock",
        Pool {
            good: &["\"cached\"", "\"precise\""],
            bad: &["\"sometimes\"", "1"],
        },
    ),
    (
        "reap",
        Pool {
            good: &["\"eager\"", "\"lazy\""],
            bad: &["\"\""],
        },
    ),
    (
        "stats",
        Pool {
            good: &["\"on\"", "\"off\""],
            bad: &["true"],
        },
    ),
    (
        "flush",
        Pool {
            good: &["\"batched\"", "\"serial\""],
            bad: &["\"never\""],
        },
    ),
    (
        "dispatch",
        Pool {
            good: &["\"inline\"", "\"handoff\""],
            bad: &["\"inline \""],
        },
    ),
    (
        "writeback",
        Pool {
            good: &["\"per-device\"", "\"shared\""],
            bad: &["\"per_device\""],
        },
    ),
];
const WRITEBACK: [(&str, Pool); 4] = [
    (
        "background",
        Pool {
            good: &["\"10%\"", "\"64K\"", "\"5%\""],
            bad: &["\"100G\"", "\"150%\"", "\"-1%\"", "\"30%\""],
        },
    ),
    (
        "limit",
        Pool {
            good: &["\"20%\"", "\"50%\""],
            bad: &["\"100G\"", "\"0%\"", "\"nan%\"", "0"],
        },
    ),
    (
        "expire",
        Pool {
            good: &["\"30s\"", "\"1ms\""],
            bad: &["\"0\"", "\"2d\"", "30"],
        },
    ),
    (
        "interval",
        Pool {
            good: &["\"5s\"", "\"10ms\""],
            bad: &["\"0\"", "\"2h\""],
        },
    ),
];

/// Draws values and mistakes: a careful generator makes none (beyond those it is asked
/// for by name), a careless one makes one in `mistake_percent` draws.
struct Draw {
    rng: Rng,
    mistake_percent: u64,
}

impl Draw {
    fn mistake(&mut self, percent: u64) -> bool {
        self.mistake_percent > 0 && self.rng.chance(percent)
    }

    fn value(&mut self, pool: &Pool) -> &'static str {
        if self.mistake(self.mistake_percent) {
            pool.bad[self.rng.below(pool.bad.len())]
        } else {
            pool.good[self.rng.below(pool.good.len())]
        }
    }

    /// `key = VALUE\n` with probability `percent`.
    fn maybe(&mut self, percent: u64, key: &str, pool: &Pool) -> String {
        if self.rng.chance(percent) {
            format!("{key} = {}\n", self.value(pool))
        } else {
            String::new()
        }
    }
}

/// A device name: mostly plain, sometimes unicode or with a quote, and (as a mistake)
/// empty, very long or with control characters.
fn name(d: &mut Draw, i: usize) -> String {
    if d.mistake(3) {
        return match d.rng.below(4) {
            0 => String::new(),
            1 => format!("{}{i}", "n".repeat(300)),
            2 => format!("d{i}\u{7}"),
            _ => format!("d{i}\n"),
        };
    }
    match d.rng.below(30) {
        0 => format!("диск{i}"),
        1 => format!("💾 {i}"),
        2 => format!("a'b{i}"),
        3 => format!("a.b{i}"),
        _ => format!("d{i}"),
    }
}

/// A stack file from `seed`.
pub fn generate(seed: u64) -> String {
    let mut rng = Rng::new(seed);
    // Mostly a handful of devices; sometimes a chain around the depth limit, or more
    // devices than allowed. Half the files are made carefully (chains always), so that
    // many pass and the checks after parsing are reached.
    let shape = rng.below(20);
    let n = match shape {
        0 => 60 + rng.below(10),
        1 => 4090 + rng.below(10),
        _ => 1 + rng.below(10),
    };
    let careful = shape == 0 || rng.chance(50);
    let mut d = Draw {
        rng,
        mistake_percent: if careful { 0 } else { 1 + d_percent(seed) },
    };
    let names: Vec<String> = (0..n).map(|i| name(&mut d, i)).collect();
    let mut out = String::new();
    // Device i takes its members from unused devices after it, so the graph is a forest
    // unless a member is drawn from anywhere (a cycle, a device used twice, itself).
    let mut free: Vec<bool> = vec![true; n];
    for i in 0..n {
        let kind = match shape {
            0 if i + 1 == n => "mem",
            0 => {
                let kinds = 2 + d.rng.below(3);
                *d.rng.pick(&["linear", "delay", "fault", "cache"][..kinds])
            }
            1 => "null",
            _ => d.value(&TYPES),
        };
        out += &format!("[device.{}]\n", quoted(&names[i]));
        if d.mistake(3) {
            out += "type = 7\n";
        } else {
            out += &format!("type = {}\n", quoted(kind));
        }
        let mut members = |d: &mut Draw, count: usize| -> Vec<String> {
            let mut list = Vec::new();
            for _ in 0..count {
                let m = if shape == 0 {
                    i + 1
                } else {
                    let after: Vec<usize> = (i + 1..n).filter(|&j| free[j]).collect();
                    if after.is_empty() || d.rng.chance(4) {
                        d.rng.below(n)
                    } else {
                        *d.rng.pick(&after)
                    }
                };
                free[m] = false;
                list.push(if d.mistake(3) {
                    "nobody".to_string()
                } else {
                    names[m].clone()
                });
            }
            list
        };
        match kind {
            "null" | "mem" => {
                out += &format!("size = {}\n", d.value(&SIZES));
                out += &d.maybe(20, "block", &BLOCKS);
                if kind == "mem" {
                    out += &d.maybe(20, "volatile", &BOOLS);
                }
            }
            "file" => {
                let path = if d.mistake(10) {
                    d.rng.pick(&["", "a\0b"]).to_string()
                } else {
                    // Few names, spelt several ways: the same file is often named twice.
                    let f = d.rng.below(6);
                    match d.rng.below(4) {
                        0 => format!("sub/../f{f}"),
                        1 => format!("./f{f}"),
                        _ => format!("f{f}"),
                    }
                };
                out += &format!("path = {}\n", quoted(&path));
                if !d.mistake(10) {
                    out += &format!("size = {}\n", d.value(&SIZES));
                }
                out += &d.maybe(30, "engine", &ENGINES);
                out += &d.maybe(10, "direct", &BOOLS);
            }
            "linear" | "stripe" | "mirror" | "raid10" => {
                let count = match kind {
                    "mirror" | "raid10" => 2 + d.rng.below(3),
                    _ if shape == 0 => 1,
                    _ => 1 + d.rng.below(4),
                };
                let list = members(&mut d, count);
                let mut shown: Vec<String> = list.iter().map(|m| quoted(m)).collect();
                // Superblocks on the members (arrays are created on the blank mems and
                // files), sometimes with an absent member.
                let metadata = d.rng.chance(40);
                let redundant = matches!(kind, "mirror" | "raid10");
                if metadata && ((redundant && d.rng.chance(20)) || d.mistake(5)) {
                    shown[0] = quoted("missing");
                }
                if d.mistake(3) {
                    shown.push(shown[0].clone());
                }
                if d.mistake(2) {
                    shown.push("3".into());
                }
                out += &format!("members = [{}]\n", shown.join(", "));
                if matches!(kind, "stripe" | "raid10") {
                    out += &d.maybe(50, "chunk", &CHUNKS);
                }
                if kind == "raid10" && count >= 3 {
                    out += &d.maybe(50, "copies", &COPIES);
                }
                if !metadata {
                    // The raw layout, asked for by name (arrays keep superblocks by
                    // default).
                    out += "metadata = \"none\"\n";
                } else if d.rng.chance(50) {
                    // Superblocks by name ("1"), or now and then the raw layout after all
                    // (refused with a 'missing' member), or a bad value; else the
                    // default.
                    out += &d.maybe(100, "metadata", &METADATA);
                }
            }
            "fault" | "delay" | "cache" => {
                let list = members(&mut d, 1);
                if !d.mistake(3) {
                    out += &format!("base = {}\n", quoted(&list[0]));
                }
                match kind {
                    "fault" => {
                        // Rules that never fire here: the checks run no I/O anyway.
                        out += &d.maybe(40, "fail", &FAIL);
                        out += &d.maybe(30, "after_secs", &AFTER_SECS);
                        out += &d.maybe(30, "after_ios", &COPIES);
                        out += &d.maybe(20, "probability", &PROBABILITY);
                        out += &d.maybe(20, "sectors", &SECTORS);
                        out += &d.maybe(20, "errno", &ERRNO);
                        out += &d.maybe(10, "power_cut", &BOOLS);
                    }
                    "delay" => {
                        for key in ["read", "write", "flush", "seek"] {
                            out += &d.maybe(30, key, &DURATIONS);
                        }
                        out += &d.maybe(40, "bandwidth", &BANDWIDTH);
                    }
                    _ => out += &format!("memory = {}\n", d.value(&MEMORY)),
                }
            }
            _ => {}
        }
        if d.mistake(3) {
            out += "colour = \"blue\"\n";
        }
        out.push('\n');
    }
    if d.rng.chance(20) {
        out += "[tuning]\n";
        for (key, pool) in &TUNING {
            out += &d.maybe(40, key, pool);
        }
        if d.mistake(10) {
            out += "clocks = \"cached\"\n";
        }
        out.push('\n');
    }
    if d.rng.chance(25) {
        out += "[writeback]\n";
        for (key, pool) in &WRITEBACK {
            out += &d.maybe(50, key, pool);
        }
        if d.mistake(10) {
            out += "flood = 1\n";
        }
        out.push('\n');
    }
    if d.rng.chance(20) {
        for e in 0..1 + d.rng.below(3) {
            let export = if d.rng.chance(20) {
                String::new()
            } else {
                format!("e{e}")
            };
            out += &format!("[export.{}]\n", quoted(&export));
            let device = if d.rng.chance(70) { 0 } else { d.rng.below(n) };
            out += &format!("device = {}\n", quoted(&names[device]));
            out += &d.maybe(30, "read_only", &BOOLS);
            if d.rng.chance(30) {
                out += "default = true\n";
            }
            out.push('\n');
        }
    }
    if d.mistake(3) {
        out += "[misc]\nx = 1\n";
    }
    if careful {
        out
    } else {
        corrupt(&mut d.rng, out)
    }
}

/// How often a careless file makes a mistake, in percent of draws: from rare to often.
fn d_percent(seed: u64) -> u64 {
    [2, 5, 10, 25][(seed % 4) as usize]
}

/// Now and then damages the text: cut short, a character changed, a line repeated.
fn corrupt(rng: &mut Rng, text: String) -> String {
    let cut = |rng: &mut Rng, text: &str| {
        let mut at = rng.below(text.len().max(1));
        while !text.is_char_boundary(at) {
            at -= 1;
        }
        at
    };
    match rng.below(8) {
        0 => {
            let at = cut(rng, &text);
            text[..at].to_string()
        }
        1 => {
            let at = cut(rng, &text);
            let c = *rng.pick(&['[', ']', '"', '=', '\n', '\0', 'é', '\\', '{', '#']);
            let mut t = text[..at].to_string();
            t.push(c);
            let rest = &text[at..];
            let mut chars = rest.chars();
            chars.next();
            t + chars.as_str()
        }
        2 => {
            let lines: Vec<&str> = text.lines().collect();
            if lines.is_empty() {
                return text;
            }
            let i = rng.below(lines.len());
            let mut out: Vec<&str> = lines[..=i].to_vec();
            out.push(lines[i]);
            out.extend_from_slice(&lines[i + 1..]);
            out.join("\n")
        }
        _ => text,
    }
}
