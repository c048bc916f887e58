//! The range of every numeric key of a stack file, and the bounds on the file's shape
//! (device count, depth, names, members), at their edges: the last good value parses,
//! the first bad one is refused with one line naming the device, the key, the value as
//! written and the range.
//!
//! The stack files that crashed or hung cairn are tested through the binary in
//! `crates/cli/tests/stack_cli.rs` (`crashes_and_hangs`); thousands of generated files in
//! `stack_fuzz.rs`.

use cairn_config::{limits, StackFile};

/// Machine memory the tests parse for: 16 GiB (caches may take 8 GiB).
const MEMORY: u64 = 16 << 30;

fn parse(text: &str) -> Result<StackFile, String> {
    StackFile::parse_on(text, MEMORY).map_err(|e| e.to_string())
}

/// `text` parses.
#[track_caller]
fn good(text: &str) {
    if let Err(e) = parse(text) {
        panic!("refused, but should parse: {e}\n{text}");
    }
}

/// `text` is refused with one line that contains every one of `words`.
#[track_caller]
fn bad(text: &str, words: &[&str]) {
    let e = match parse(text) {
        Ok(_) => panic!("parsed, but should be refused:\n{text}"),
        Err(e) => e,
    };
    assert_eq!(e.lines().count(), 1, "one line: {e:?}");
    for w in words {
        assert!(e.contains(w), "the message lacks {w:?}: {e}");
    }
}

const MEM: &str = "[device.m]\ntype = \"mem\"\nsize = \"64M\"\n\n";

/// `[device.x]` of `kind` over `m` with `line` added.
fn over_mem(kind: &str, line: &str) -> String {
    format!("{MEM}[device.x]\ntype = \"{kind}\"\nbase = \"m\"\n{line}\n")
}

#[test]
fn cache_memory_from_64k_to_half_of_the_machine() {
    good(&over_mem("cache", "memory = \"64K\""));
    good(&over_mem("cache", "memory = \"8G\""));
    for v in ["\"0\"", "\"63K\"", "65535", "\"8193M\"", "\"100T\""] {
        bad(
            &over_mem("cache", &format!("memory = {v}")),
            &[
                "device 'x'",
                "'memory'",
                v,
                "64KiB",
                "8GiB",
                "half of this machine's memory",
            ],
        );
    }
    // Caches together, too.
    let two = format!(
        "{MEM}[device.n]\ntype = \"mem\"\nsize = \"64M\"\n\n\
         [device.c1]\ntype = \"cache\"\nbase = \"m\"\nmemory = \"5G\"\n\n\
         [device.c2]\ntype = \"cache\"\nbase = \"n\"\nmemory = \"5G\"\n"
    );
    bad(&two, &["'c1'", "'c2'", "10GiB", "8GiB"]);
}

#[test]
fn delay_bandwidth_above_zero_and_latencies_bounded() {
    good(&over_mem("delay", "bandwidth = \"1M\""));
    for v in ["\"0\"", "0", "\"1023K\"", "\"1\""] {
        bad(
            &over_mem("delay", &format!("bandwidth = {v}")),
            &["device 'x'", "'bandwidth'", v, "at least 1MiB a second"],
        );
    }
    for key in ["read", "write", "flush", "seek"] {
        good(&over_mem("delay", &format!("{key} = \"10s\"")));
        good(&over_mem("delay", &format!("{key} = \"0\"")));
        for v in ["\"10001ms\"", "\"1h\"", "\"100000s\""] {
            bad(
                &over_mem("delay", &format!("{key} = {v}")),
                &["device 'x'", &format!("'{key}'"), v, "from 0s to 10s"],
            );
        }
    }
}

#[test]
fn fault_after_secs_is_bounded_and_never_panics() {
    good(&over_mem("fault", "after_secs = 2.5"));
    good(&over_mem("fault", "after_secs = \"365d\""));
    for v in ["1e300", "31536001", "\"366d\""] {
        bad(
            &over_mem("fault", &format!("after_secs = {v}")),
            &["device 'x'", "'after_secs'", "from 0s to 365d"],
        );
    }
    bad(&over_mem("fault", "after_secs = -1"), &["'after_secs'"]);
    bad(&over_mem("fault", "after_secs = nan"), &["'after_secs'"]);
}

#[test]
fn block_chunk_and_sizes() {
    let leaf = |line: &str| format!("[device.m]\ntype = \"mem\"\n{line}\n");
    good(&leaf("size = \"64M\"\nblock = \"64K\""));
    bad(
        &leaf("size = \"64M\"\nblock = \"128K\""),
        &["'m'", "'block'", "from 512B to 64KiB"],
    );
    bad(
        &leaf("size = \"64M\"\nblock = \"3072\""),
        &["'m'", "'block'", "power of two"],
    );
    bad(&leaf("size = \"0\""), &["'m'", "'size'", "\"0\""]);
    bad(
        &leaf("size = \"1000\""),
        &["'m'", "'size'", "512-byte blocks"],
    );
    good(&leaf("size = \"64T\""));
    bad(&leaf("size = \"65T\""), &["'m'", "'size'", "64TiB"]);
    let null = |size: &str| format!("[device.n]\ntype = \"null\"\nsize = \"{size}\"\n");
    good(&null("1024P"));
    bad(&null("1025P"), &["'n'", "'size'", "1024PiB"]);
    let file = |size: &str| {
        format!("[device.f]\ntype = \"file\"\npath = \"/nonexistent/f\"\nsize = \"{size}\"\n")
    };
    bad(&file("0"), &["'f'", "'size'", "from 512B"]);
    bad(
        "[device.f]\ntype = \"file\"\npath = \"\"\n",
        &["'f'", "'path'"],
    );

    let stripe = |chunk: &str| {
        format!(
            "{MEM}[device.n]\ntype = \"mem\"\nsize = \"64M\"\n\n\
             [device.s]\ntype = \"stripe\"\nmembers = [\"m\", \"n\"]\nchunk = \"{chunk}\"\n"
        )
    };
    good(&stripe("512"));
    good(&stripe("1G"));
    bad(&stripe("256"), &["'s'", "'chunk'", "from 512B to 1GiB"]);
    bad(&stripe("2G"), &["'s'", "'chunk'", "from 512B to 1GiB"]);
}

#[test]
fn members_and_copies() {
    let many = |kind: &str, n: usize, extra: &str| {
        let mut text: String = (0..n)
            .map(|i| format!("[device.m{i}]\ntype = \"null\"\nsize = \"1M\"\n"))
            .collect();
        let names: Vec<String> = (0..n).map(|i| format!("\"m{i}\"")).collect();
        text += &format!(
            "[device.top]\ntype = \"{kind}\"\nmembers = [{}]\n{extra}",
            names.join(", ")
        );
        text
    };
    good(&many("stripe", limits::MEMBERS_MAX, ""));
    bad(
        &many("stripe", limits::MEMBERS_MAX + 1, ""),
        &["'top'", "'members'", "257", "from 1 to 256"],
    );
    good(&many("mirror", 32, ""));
    bad(
        &many("mirror", 33, ""),
        &["'top'", "'members'", "from 2 to 32"],
    );
    bad(
        &many("mirror", 1, ""),
        &["'top'", "'members'", "from 2 to 32"],
    );
    good(&many("raid10", 4, "copies = 4\n"));
    bad(
        &many("raid10", 4, "copies = 5\n"),
        &[
            "'top'",
            "'copies'",
            "= 5",
            "from 2 to the number of members, 4",
        ],
    );
    bad(&many("raid10", 4, "copies = 1\n"), &["'top'", "'copies'"]);

    // A list far longer than allowed is refused by its length, not after a quadratic
    // search for names given twice.
    let names: Vec<String> = (0..100_000).map(|i| format!("\"m{i}\"")).collect();
    let text = format!(
        "[device.top]\ntype = \"linear\"\nmembers = [{}]\n",
        names.join(",")
    );
    bad(&text, &["'top'", "'members'", "100000"]);
}

#[test]
fn depth_at_most_64_levels_with_the_chain_printed() {
    let chain = |levels: usize| {
        let n = levels - 1;
        let mut text: String = (0..n)
            .map(|i| {
                format!(
                    "[device.l{i}]\ntype = \"linear\"\nmembers = [\"l{}\"]\n",
                    i + 1
                )
            })
            .collect();
        text += &format!("[device.l{n}]\ntype = \"null\"\nsize = \"1M\"\n");
        text
    };
    good(&chain(64));
    bad(
        &chain(65),
        &[
            "device 'l64'",
            "65 levels",
            "at most 64",
            "'l0' -> 'l1' -> 'l2'",
            "-> 'l64'",
        ],
    );
    // A chain of more devices than allowed is refused by the count.
    bad(&chain(limits::DEVICES_MAX + 1), &["4097 devices", "4096"]);
    // The depth of a tree is its deepest branch, found wherever it hangs.
    let mut text = chain(64);
    text += "[device.top]\ntype = \"mirror\"\nmembers = [\"l0\", \"x\"]\n[device.x]\ntype = \"null\"\nsize = \"1M\"\n";
    bad(&text, &["device 'l63'", "65 levels", "'top' -> 'l0'"]);
}

#[test]
fn names_without_control_characters() {
    good("[device.\"диск 💾\"]\ntype = \"null\"\nsize = \"1M\"\n");
    bad(
        "[device.\"\"]\ntype = \"null\"\nsize = \"1M\"\n",
        &["device name", "is empty"],
    );
    bad(
        "[device.\"a\\nb\"]\ntype = \"null\"\nsize = \"1M\"\n",
        &["device name 'a\\nb'", "control character"],
    );
    let long = "n".repeat(limits::NAME_BYTES_MAX + 1);
    bad(
        &format!("[device.{long}]\ntype = \"null\"\nsize = \"1M\"\n"),
        &["device name", "too long"],
    );
    // A member name from the input is printed escaped, on one line.
    bad(
        "[device.l]\ntype = \"linear\"\nmembers = [\"a\\nb\"]\n",
        &["'l'", "'a\\nb'", "not defined"],
    );
}

#[test]
fn writeback_levels_fit_the_caches() {
    let cache = |wb: &str| {
        format!(
            "{}[writeback]\n{wb}\n",
            over_mem("cache", "memory = \"1M\"")
        )
    };
    good(&cache("limit = \"1M\""));
    good(&cache("background = \"64K\"\nlimit = \"128K\""));
    bad(
        &cache("limit = \"100G\""),
        &["writeback", "'limit'", "100GiB", "1MiB"],
    );
    bad(&cache("limit = \"1025K\""), &["writeback", "'limit'"]);
    bad(
        &cache("background = \"512K\"\nlimit = \"256K\""),
        &["writeback", "'background'", "below", "'limit'"],
    );
    bad(
        &cache("interval = \"0\""),
        &["writeback", "'interval'", "from 1ms to 1h"],
    );
    bad(
        &cache("interval = \"2h\""),
        &["writeback", "'interval'", "from 1ms to 1h"],
    );
    bad(
        &cache("expire = \"25h\""),
        &["writeback", "'expire'", "from 1ms to 1d"],
    );
    good(&cache("expire = \"1d\"\ninterval = \"1h\""));
}

#[test]
fn a_stack_file_longer_than_allowed() {
    let text = format!("{MEM}#{}\n", "x".repeat(limits::FILE_BYTES_MAX as usize));
    bad(&text, &["the stack file", "at most 1048576"]);
}

/// A mirror `r` of two 64 MiB mems with `extra` lines.
fn mirror(extra: &str) -> String {
    format!(
        "{MEM}[device.n]\ntype = \"mem\"\nsize = \"64M\"\n\n\
         [device.r]\ntype = \"mirror\"\nmembers = [\"m\", \"n\"]\n{extra}\n"
    )
}

/// Keys of arrays with metadata (the default) are refused in the raw layout, with a
/// message naming the array, the key and what is in the way.
#[track_caller]
fn needs_metadata(key: &str, value: &str) {
    bad(
        &mirror(&format!("metadata = \"none\"\n{key} = {value}")),
        &[
            "'r'",
            &format!("'{key}'"),
            "needs metadata",
            "not metadata = \"none\"",
        ],
    );
}

#[test]
fn rebuild_rates_need_metadata_and_a_sane_range() {
    // Arrays keep superblocks by default, so the keys need no metadata line; asking for
    // metadata by name is the same.
    good(&mirror("rebuild_min = \"1M\"\nrebuild_max = \"1G\""));
    good(&mirror(
        "metadata = \"1\"\nrebuild_min = \"1M\"\nrebuild_max = \"1G\"",
    ));
    needs_metadata("rebuild_max", "\"1G\"");
    needs_metadata("rebuild_min", "\"1M\"");
    bad(
        &mirror("rebuild_min = \"0\""),
        &["'r'", "'rebuild_min'", "at least 1MiB"],
    );
    bad(
        &mirror("rebuild_min = \"64M\"\nrebuild_max = \"32M\""),
        &["'r'", "'rebuild_max'", "below rebuild_min"],
    );
}

#[test]
fn bitmap_keys_need_metadata_a_power_of_two_and_a_sane_range() {
    good(&mirror("bitmap = \"1M\"\nbitmap_delay = \"1s\""));
    good(&mirror(
        "metadata = \"1\"\nbitmap = \"1M\"\nbitmap_delay = \"1s\"",
    ));
    good(&mirror("bitmap = \"none\""));
    needs_metadata("bitmap", "\"1M\"");
    needs_metadata("bitmap", "\"none\"");
    needs_metadata("bitmap_delay", "\"1s\"");
    bad(
        &mirror("bitmap = \"3M\""),
        &["'r'", "'bitmap'", "power of two"],
    );
    bad(
        &mirror("bitmap = \"32K\""),
        &["'r'", "'bitmap'", "from 64KiB"],
    );
    bad(&mirror("bitmap = \"lots\""), &["'r'", "'bitmap'"]);
    bad(
        &mirror("bitmap_delay = \"10ms\""),
        &["'r'", "'bitmap_delay'", "out of range"],
    );
    bad(
        &mirror("bitmap = \"none\"\nbitmap_delay = \"1s\""),
        &["'r'", "'bitmap_delay'", "none"],
    );
    // readd: a time from 100ms to 1h, or "none"; with metadata only.
    good(&mirror("readd = \"100ms\""));
    good(&mirror("readd = \"1h\""));
    good(&mirror("readd = \"none\""));
    good(&mirror("metadata = \"1\"\nreadd = \"5s\""));
    needs_metadata("readd", "\"5s\"");
    bad(
        &mirror("readd = \"50ms\""),
        &["'r'", "'readd'", "out of range"],
    );
    bad(
        &mirror("readd = \"2h\""),
        &["'r'", "'readd'", "out of range"],
    );
    bad(&mirror("readd = \"soon\""), &["'r'", "'readd'"]);
}

/// An nbd device's keys: a URI that parses (checked when the file is read, before any
/// connection), connections from 1 to 16, a timeout from 100ms to 24h.
#[test]
fn nbd_uri_connections_and_timeout() {
    let nbd = |line: &str| format!("[device.r]\ntype = \"nbd\"\n{line}\n");
    good(&nbd(
        "uri = \"nbd://10.0.0.1/disk\"\nconnections = 16\ntimeout = \"100ms\"",
    ));
    good(&nbd(
        "uri = \"nbds+unix:///?socket=/run/s.sock\"\ntimeout = 5",
    ));
    bad(&nbd("connections = 2"), &["'r'", "'uri'", "missing"]);
    bad(
        &nbd("uri = \"http://x/\""),
        &["'r'", "'uri'", "unknown scheme"],
    );
    bad(&nbd("uri = \"nbd+unix:///\""), &["'r'", "'uri'", "socket"]);
    bad(&nbd("uri = 7"), &["'r'", "'uri'"]);
    for n in ["0", "17"] {
        bad(
            &nbd(&format!("uri = \"nbd://h/\"\nconnections = {n}")),
            &["'r'", "'connections'", "out of range"],
        );
    }
    for t in ["\"50ms\"", "\"25h\""] {
        bad(
            &nbd(&format!("uri = \"nbd://h/\"\ntimeout = {t}")),
            &["'r'", "'timeout'", "out of range"],
        );
    }
    bad(&nbd("uri = \"nbd://h/\"\ntls = true"), &["'r'", "'tls'"]);
}
