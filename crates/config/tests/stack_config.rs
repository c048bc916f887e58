//! Stack files: every validation error, and the few things that must parse.
//!
//! Each mistake gets its own small file, and the test checks that the message names the
//! device at fault (quoted, as `'d0'`) and the key that is wrong, so a user can find the
//! line to change. Errors found while parsing come from [`StackFile::parse`]; errors that
//! need the members' sizes or block sizes (a chunk smaller than a block, members smaller
//! than a chunk) come from [`StackFile::open`]. The bounds of every key, and stack files
//! built to crash or hang cairn, are in `stack_bounds.rs`.
//!
//! Not here: where data lands (`stack_layout.rs`), data against a model
//! (`stack_model.rs`), the `cairn check` command (`crates/cli/tests/stack_cli.rs`).

use cairn_config::{DeviceSpec, StackFile, DEFAULT_CHUNK_BYTES};
use cairn_core::Error;
use cairn_leaves::LeafSpec;

/// A `[device.NAME]` table of a 1 MiB mem device.
fn mem(name: &str) -> String {
    format!("[device.{name}]\ntype = \"mem\"\nsize = \"1M\"\n\n")
}

/// Mem devices `d0` .. `d{n-1}`.
fn mems(n: usize) -> String {
    (0..n).map(|i| mem(&format!("d{i}"))).collect()
}

/// `["d0", "d1", ...]`.
fn list(n: usize) -> String {
    let names: Vec<String> = (0..n).map(|i| format!("\"d{i}\"")).collect();
    format!("[{}]", names.join(", "))
}

/// The message of the error `parse` returns; panics if the text parses.
fn parse_err(text: &str) -> String {
    match StackFile::parse(text) {
        Ok(f) => panic!("parsed, but should not have:\n{text}\n=> {f:?}"),
        Err(e) => {
            assert!(matches!(e, Error::Invalid(_)), "{e:?}");
            e.to_string()
        }
    }
}

/// The message of the error parsing `text` or, if it parses, opening `name` returns:
/// some mistakes are found in the text alone, others only once the members' sizes and
/// block sizes are known.
fn open_err(text: &str, name: &str) -> String {
    let file = match StackFile::parse(text) {
        Ok(f) => f,
        Err(e) => return e.to_string(),
    };
    match file.open(name) {
        Ok(d) => panic!(
            "opened '{name}' ({} bytes), but should not have:\n{text}",
            d.geometry().size_bytes
        ),
        Err(e) => e.to_string(),
    }
}

/// The message names `device` (quoted) and mentions `key`.
#[track_caller]
fn assert_names(message: &str, device: &str, key: &str) {
    assert!(
        message.contains(&format!("'{device}'")),
        "the message does not name device '{device}': {message}"
    );
    assert!(
        message.contains(key),
        "the message does not name key {key}: {message}"
    );
    assert_eq!(message.lines().count(), 1, "one line: {message:?}");
}

mod parses {
    use super::*;

    #[test]
    fn a_raid10_of_files_and_mems_with_defaults() {
        let text = format!(
            "[tuning]\nclock = \"precise\"\ncoalesce = \"off\"\n\n\
             [device.f]\ntype = \"file\"\npath = \"/dev/shm/x\"\nsize = \"2M\"\nengine = \"aio\"\ndirect = true\n\n\
             {}\
             [device.r]\ntype = \"raid10\"\nmembers = [\"f\", \"d1\", \"d2\", \"d3\"]\n",
            (1..4).map(|i| mem(&format!("d{i}"))).collect::<String>()
        );
        let file = StackFile::parse(&text).unwrap();
        assert_eq!(file.tuning.clock, Some(cairn_core::ClockMode::Precise));
        assert_eq!(file.tuning.reap, None);
        assert_eq!(file.tuning.coalesce, Some(cairn_core::CoalesceMode::Off));
        assert_eq!(
            file.tuning.over(cairn_core::Switches::default()).coalesce,
            cairn_core::CoalesceMode::Off
        );
        assert_eq!(file.roots(), vec!["r".to_string()]);
        assert_eq!(file.pick(None).unwrap(), "r");
        assert_eq!(file.pick(Some("d1")).unwrap(), "d1");
        assert_eq!(
            file.devices["r"],
            DeviceSpec::Raid10 {
                members: vec!["f".into(), "d1".into(), "d2".into(), "d3".into()],
                spares: Vec::new(),
                chunk: DEFAULT_CHUNK_BYTES,
                copies: 2,
                // Superblocks unless the file says metadata = "none".
                metadata: true,
                rebuild: cairn_config::ArrayOptions::default(),
            }
        );
        assert_eq!(
            file.devices["f"],
            DeviceSpec::Leaf(LeafSpec::File {
                path: "/dev/shm/x".into(),
                engine: cairn_leaves::Engine::Aio,
                direct: true,
                size_bytes: Some(2 << 20),
                sparse: false,
            })
        );
        assert_eq!(
            file.devices["d1"],
            DeviceSpec::Leaf(LeafSpec::Mem {
                size_bytes: 1 << 20,
                block_bytes: 512,
                volatile: false,
            })
        );
    }

    #[test]
    fn a_delay_that_models_a_rotational_disk() {
        let text = format!(
            "{}[device.hdd]\ntype = \"delay\"\nbase = \"d0\"\nbandwidth = \"150M\"\nseek = \"8ms\"\nflush = \"1ms\"\n",
            mem("d0")
        );
        let file = StackFile::parse(&text).unwrap();
        let DeviceSpec::Delay { delays, .. } = &file.devices["hdd"] else {
            panic!("{:?}", file.devices["hdd"])
        };
        assert_eq!(delays.bandwidth, Some(150 << 20));
        assert_eq!(delays.seek, std::time::Duration::from_millis(8));
        assert!(delays.models_a_disk());
        let d = file.open("hdd").unwrap();
        assert!(d.describe().contains("seek +8ms"), "{}", d.describe());
    }

    #[test]
    fn a_delay_with_a_bad_bandwidth_or_seek_names_the_key() {
        for (key, value) in [
            ("bandwidth", "\"fast\""),
            ("seek", "\"soon\""),
            ("seek", "-1"),
        ] {
            let text = format!(
                "{}[device.hdd]\ntype = \"delay\"\nbase = \"d0\"\n{key} = {value}\n",
                mem("d0")
            );
            assert_names(&parse_err(&text), "hdd", key);
        }
    }

    #[test]
    fn throttles_alone_and_in_a_group() {
        let text = format!(
            "{}{}[device.t0]\ntype = \"throttle\"\nbase = \"d0\"\ngroup = \"tenants\"\niops = 10000\nbps_write = \"50M\"\nbps_write_max = \"100M\"\nbps_write_max_length = 5\n\
             [device.t1]\ntype = \"throttle\"\nbase = \"d1\"\ngroup = \"tenants\"\n",
            mem("d0"),
            mem("d1")
        );
        let file = StackFile::parse(&text).unwrap();
        let DeviceSpec::Throttle { group, limits, .. } = &file.devices["t0"] else {
            panic!("{:?}", file.devices["t0"])
        };
        assert_eq!(group.as_deref(), Some("tenants"));
        let l = limits.unwrap();
        assert_eq!(
            (
                l.iops.avg,
                l.bps_write.avg,
                l.bps_write.max,
                l.bps_write.max_length
            ),
            (10_000, 50 << 20, 100 << 20, 5)
        );
        let d = file.open("t1").unwrap();
        assert!(
            d.describe().contains("iops 10000/s") && d.describe().contains("group tenants"),
            "{}",
            d.describe()
        );
    }

    #[test]
    fn exports_with_limits_go_through_a_throttle_of_their_own() {
        let text = format!(
            "{}[export.a]\ndevice = \"d0\"\niops = 500\ngroup = \"tenants\"\n\
             [export.b]\ndevice = \"d0\"\ngroup = \"tenants\"\n[export.c]\ndevice = \"d0\"\n",
            mem("d0")
        );
        let file = StackFile::parse(&text).unwrap();
        assert_eq!(file.exports["a"].device, "export:a");
        assert_eq!(file.exports["b"].device, "export:b");
        assert_eq!(file.exports["c"].device, "d0");
        let DeviceSpec::Throttle {
            base,
            group,
            limits,
        } = &file.devices["export:a"]
        else {
            panic!("{:?}", file.devices)
        };
        assert_eq!((base.as_str(), group.as_deref()), ("d0", Some("tenants")));
        assert_eq!(limits.unwrap().iops.avg, 500);
        let a = file.open("export:a").unwrap();
        assert!(a.describe().contains("iops 500/s"), "{}", a.describe());
        // Bad limits name the export.
        let m = parse_err(&format!(
            "{}[export.a]\ndevice = \"d0\"\nbps = 0\n",
            mem("d0")
        ));
        assert!(m.contains("export 'a'") && m.contains("'bps'"), "{m}");
        let m = parse_err(&format!(
            "{}[device.\"export:a\"]\ntype = \"mem\"\nsize = \"1M\"\n[export.a]\ndevice = \"d0\"\niops = 5\n",
            mem("d0")
        ));
        assert!(m.contains("taken"), "{m}");
    }

    #[test]
    fn a_bad_throttle_names_the_key_or_the_group() {
        for (keys, key) in [
            ("iops = 0", "iops"),
            ("iops = -5", "iops"),
            ("bps = \"fast\"", "bps"),
            ("iops = 100\niops_max = 50", "iops_max"),
            ("iops_max = 50", "iops_max"),
            ("iops = 100\niops_max_length = 3", "iops_max_length"),
            (
                "iops = 100\niops_max = 200\niops_max_length = 0",
                "iops_max_length",
            ),
            ("iops = 100\niops_read = 50", "iops"),
            ("bps = 1125899906842625", "bps"),
            ("iops = 5\nburst = 3", "burst"),
            ("", "limit"),
        ] {
            let text = format!(
                "{}[device.t]\ntype = \"throttle\"\nbase = \"d0\"\n{keys}\n",
                mem("d0")
            );
            assert_names(&parse_err(&text), "t", key);
        }
        // A group with no limits, and one given two ways.
        for (a, b, says) in [
            ("", "", "has no limits"),
            ("iops = 100\n", "iops = 200\n", "different limits"),
        ] {
            let text = format!(
                "{}{}[device.t0]\ntype = \"throttle\"\nbase = \"d0\"\ngroup = \"g\"\n{a}\
                 [device.t1]\ntype = \"throttle\"\nbase = \"d1\"\ngroup = \"g\"\n{b}",
                mem("d0"),
                mem("d1")
            );
            let m = parse_err(&text);
            assert!(m.contains("'g'") && m.contains(says), "{m}");
        }
    }

    #[test]
    fn a_bad_crypt_names_the_key() {
        for (keys, key) in [
            ("", "passphrase_file"),
            (
                "passphrase = \"hunter2\"",
                "never written in the stack file",
            ),
            ("key = \"00\"", "never written in the stack file"),
            ("passphrase_file = \"\"", "passphrase_file"),
            ("passphrase_file = 5", "passphrase_file"),
            ("key_file = \"k\"\ncreate = true", "passphrase_file"),
            ("passphrase_file = \"p\"\nformat = \"luks3\"", "format"),
            (
                "passphrase_file = \"p\"\ncreate = true\nsector_size = 1024",
                "sector_size",
            ),
            (
                "passphrase_file = \"p\"\ncreate = true\nformat = \"luks1\"\nsector_size = 4096",
                "sector_size",
            ),
            (
                "passphrase_file = \"p\"\nsector_size = 512",
                "only for create",
            ),
            (
                "passphrase_file = \"p\"\ncreate = true\nkey_size = 384",
                "key_size",
            ),
            ("passphrase_file = \"p\"\nkdf = \"scrypt\"", "kdf"),
            (
                "passphrase_file = \"p\"\nkdf = \"pbkdf2\"\nkdf_iterations = 999",
                "kdf_iterations",
            ),
            (
                "passphrase_file = \"p\"\nkdf = \"pbkdf2\"\nkdf_memory = \"64M\"",
                "kdf_memory",
            ),
            ("passphrase_file = \"p\"\nkdf_memory = \"8K\"", "kdf_memory"),
            ("passphrase_file = \"p\"\nkdf_parallel = 0", "kdf_parallel"),
            (
                "passphrase_file = \"p\"\nkdf = \"argon2id\"\nkdf_hash = \"sha1\"",
                "kdf_hash",
            ),
            ("passphrase_file = \"p\"\nkdf_hash = \"md5\"", "kdf_hash"),
            (
                "passphrase_file = \"p\"\nformat = \"luks1\"\nkdf = \"argon2id\"",
                "kdf",
            ),
            ("passphrase_file = \"p\"\ncipher = \"serpent\"", "cipher"),
        ] {
            let text = format!(
                "{}[device.c]\ntype = \"crypt\"\nbase = \"d0\"\n{keys}\n",
                mem("d0")
            );
            assert_names(&parse_err(&text), "c", key);
        }
        // A passphrase file that is not there: named when the device opens.
        let text = format!(
            "{}[device.c]\ntype = \"crypt\"\nbase = \"d0\"\npassphrase_file = \"/nonexistent/p\"\n",
            mem("d0")
        );
        let m = open_err(&text, "c");
        assert!(m.contains("'c'") && m.contains("/nonexistent/p"), "{m}");
    }

    #[test]
    fn a_fault_with_a_bad_times_names_the_key() {
        for value in ["-1", "\"once\"", "1.5"] {
            let text = format!(
                "{}[device.bad]\ntype = \"fault\"\nbase = \"d0\"\ntimes = {value}\n",
                mem("d0")
            );
            assert_names(&parse_err(&text), "bad", "times");
        }
    }

    #[test]
    fn a_writeback_table() {
        let text = format!(
            "[writeback]\nbackground = \"10%\"\nlimit = \"64M\"\nexpire = \"2s\"\n\n{}",
            mem("d0")
        );
        let w = StackFile::parse(&text).unwrap().writeback.unwrap();
        assert_eq!(
            w.limit,
            cairn_stacks::cache::writeback::Amount::Bytes(64 << 20)
        );
        let e = StackFile::parse(&format!("[writeback]\nlimt = \"1G\"\n\n{}", mem("d0")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("writeback") && e.contains("limt"), "{e}");
    }

    #[test]
    fn sizes_as_numbers_and_strings() {
        let text = "[device.a]\ntype = \"null\"\nsize = 1048576\nblock = 4096\n\n\
                    [device.b]\ntype = \"mem\"\nsize = \"1MiB\"\nblock = \"4k\"\n";
        let file = StackFile::parse(text).unwrap();
        for name in ["a", "b"] {
            let d = file.open(name).unwrap();
            assert_eq!(d.geometry().size_bytes, 1 << 20, "{name}");
            assert_eq!(d.geometry().block_bytes, 4096, "{name}");
        }
        assert_eq!(file.roots(), vec!["a".to_string(), "b".to_string()]);
    }

    #[test]
    fn every_stacked_type_opens_with_the_size_its_layout_gives() {
        // Four members with 1 MiB for data each: linear 4 MiB, stripe 4 MiB, mirror 1 MiB,
        // raid10 (2 copies) 2 MiB, raid10 with 3 copies: 16 rows x 4 members / 3 = 21
        // chunks of 64 KiB. In the raw layout that is the whole of a 1 MiB member; at the
        // default, a 2 MiB member less its 1 MiB metadata area.
        let raw = mems(4);
        let with_superblocks: String = (0..4)
            .map(|i| format!("[device.d{i}]\ntype = \"mem\"\nsize = \"2M\"\n\n"))
            .collect();
        for (members, metadata) in [(&raw, "metadata = \"none\"\n"), (&with_superblocks, "")] {
            for (kind, extra, size) in [
                ("linear", "", 4 << 20),
                ("stripe", "chunk = \"64K\"\n", 4 << 20),
                ("mirror", "", 1 << 20),
                ("raid10", "", 2 << 20),
                ("raid10", "copies = 3\n", 21 * (64 << 10)),
            ] {
                let text = format!(
                    "{members}[device.top]\ntype = \"{kind}\"\nmembers = {}\n{metadata}{extra}",
                    list(4)
                );
                let file = StackFile::parse(&text).unwrap_or_else(|e| panic!("{kind}: {e}"));
                let top = file.open("top").unwrap_or_else(|e| panic!("{kind}: {e}"));
                assert_eq!(top.geometry().size_bytes, size, "{kind} {metadata}{extra}");
                assert_eq!(
                    top.describe().contains("metadata 1, data at 1048576"),
                    metadata.is_empty(),
                    "{kind} {metadata}{extra}: {}",
                    top.describe()
                );
                let children: Vec<String> = top
                    .children()
                    .iter()
                    .map(|c| c.name().to_string())
                    .collect();
                assert_eq!(children, ["d0", "d1", "d2", "d3"], "{kind}");
            }
        }
    }

    #[test]
    fn stacks_nest() {
        // A mirror of two stripes, each of two 2 MiB mem devices, every array with its
        // superblocks: each stripe 2 x (2 MiB - 1 MiB of metadata) = 2 MiB, the mirror
        // 2 MiB - 1 MiB of metadata.
        let members: String = (0..4)
            .map(|i| format!("[device.d{i}]\ntype = \"mem\"\nsize = \"2M\"\n\n"))
            .collect();
        let text = format!(
            "{members}[device.s0]\ntype = \"stripe\"\nmembers = [\"d0\", \"d1\"]\nchunk = \"4K\"\n\n\
             [device.s1]\ntype = \"stripe\"\nmembers = [\"d2\", \"d3\"]\nchunk = \"4K\"\n\n\
             [device.m]\ntype = \"mirror\"\nmembers = [\"s0\", \"s1\"]\n"
        );
        let file = StackFile::parse(&text).unwrap();
        assert_eq!(file.roots(), vec!["m".to_string()]);
        let m = file.open("m").unwrap();
        assert_eq!(m.geometry().size_bytes, 1 << 20);
        for s in m.children() {
            assert_eq!(s.geometry().size_bytes, 2 << 20, "{}", s.name());
        }
        let tree = cairn_config::tree(&*m);
        let names: Vec<&str> = tree
            .lines()
            .map(|l| l.split_whitespace().next().unwrap())
            .collect();
        assert_eq!(names, ["m", "s0", "d0", "d1", "s1", "d2", "d3"], "{tree}");
        assert!(tree.lines().nth(1).unwrap().starts_with("  s0"), "{tree}");
        assert!(tree.lines().nth(2).unwrap().starts_with("    d0"), "{tree}");
    }
}

mod types_and_keys {
    use super::*;

    #[test]
    fn an_rbd_table_gives_the_image_and_how_to_reach_it() {
        let text = "[device.img]\ntype = \"rbd\"\npool = \"rbd\"\nnamespace = \"vm\"\n\
                    image = \"disk0\"\nconf = \"/etc/ceph/ceph.conf\"\nid = \"client.cairn\"\n\
                    snapshot = \"s1\"\ntimeout = \"5s\"\nconnection = \"image\"\n";
        let file = StackFile::parse(text).unwrap();
        let Some(DeviceSpec::Leaf(LeafSpec::Rbd(t))) = file.devices.get("img") else {
            panic!("{file:?}");
        };
        assert_eq!(t.path(), "rbd/vm/disk0@s1");
        assert_eq!(t.id.as_deref(), Some("cairn"));
        assert_eq!(t.timeout, std::time::Duration::from_secs(5));
        assert_eq!(t.connection, cairn_leaves::rbd::Connection::Image);
        // What `stack_table` writes parses back to the same.
        let again = format!("[device.img]\n{}", LeafSpec::Rbd(t.clone()).stack_table());
        let file = StackFile::parse(&again).unwrap();
        let Some(DeviceSpec::Leaf(LeafSpec::Rbd(back))) = file.devices.get("img") else {
            panic!("{again}");
        };
        assert_eq!(back, t);
    }

    #[test]
    fn a_bad_rbd_table_names_the_key() {
        let base = "[device.img]\ntype = \"rbd\"\n";
        for (keys, key) in [
            ("image = \"d\"\n", "pool"),
            ("pool = \"rbd\"\n", "image"),
            ("pool = \"rbd\"\nimage = \"a/b\"\n", "image"),
            ("pool = \"\"\nimage = \"d\"\n", "pool"),
            ("pool = \"rbd\"\nimage = \"d@s\"\n", "image"),
            (
                "pool = \"rbd\"\nimage = \"d\"\ntimeout = \"0s\"\n",
                "timeout",
            ),
            (
                "pool = \"rbd\"\nimage = \"d\"\ntimeout = \"1500ms\"\n",
                "timeout",
            ),
            (
                "pool = \"rbd\"\nimage = \"d\"\ntimeout = \"2d\"\n",
                "timeout",
            ),
            (
                "pool = \"rbd\"\nimage = \"d\"\nconnection = \"pooled\"\n",
                "connection",
            ),
            ("pool = \"rbd\"\nimage = \"d\"\nconf = \"\"\n", "conf"),
            ("pool = \"rbd\"\nimage = \"d\"\nsize = \"1G\"\n", "size"),
            ("pool = 5\nimage = \"d\"\n", "pool"),
        ] {
            assert_names(&parse_err(&format!("{base}{keys}")), "img", key);
        }
    }

    #[test]
    fn unknown_type() {
        let m = parse_err("[device.x]\ntype = \"disk\"\nsize = \"1M\"\n");
        assert_names(&m, "x", "type");
        assert!(m.contains("disk"), "{m}");
        // fault and delay are other types; nothing else is.
        for kind in ["raid5", "Mem", ""] {
            let m = parse_err(&format!("[device.x]\ntype = \"{kind}\"\nsize = \"1M\"\n"));
            assert_names(&m, "x", "type");
        }
    }

    #[test]
    fn type_that_is_not_a_string() {
        let m = parse_err("[device.x]\ntype = 5\nsize = \"1M\"\n");
        assert_names(&m, "x", "'type'");
    }

    #[test]
    fn unknown_key() {
        let m = parse_err("[device.d0]\ntype = \"mem\"\nsize = \"1M\"\ncolour = \"red\"\n");
        assert_names(&m, "d0", "'colour'");
        // A key of another type is unknown here: copies belongs to raid10, chunk to
        // stripe and raid10, path to file.
        for (kind, key) in [
            ("stripe", "copies = 2"),
            ("mirror", "chunk = \"64K\""),
            ("linear", "chunk = \"64K\""),
            ("raid10", "size = \"1M\""),
        ] {
            let text = format!(
                "{}[device.top]\ntype = \"{kind}\"\nmembers = {}\n{key}\n",
                mems(4),
                list(4)
            );
            let name = key.split_whitespace().next().unwrap();
            let m = parse_err(&text);
            assert_names(&m, "top", &format!("'{name}'"));
        }
        let m = parse_err("[device.n]\ntype = \"null\"\nsize = \"1M\"\npath = \"/x\"\n");
        assert_names(&m, "n", "'path'");
        let m = parse_err("[device.f]\ntype = \"file\"\npath = \"/x\"\nblock = 512\n");
        assert_names(&m, "f", "'block'");
    }

    #[test]
    fn missing_type() {
        let m = parse_err("[device.d0]\nsize = \"1M\"\n");
        assert_names(&m, "d0", "'type'");
        assert!(!m.contains("quoted"), "{m}");
        // A name with a dot, unquoted (as `admin add` names a file member): the hint
        // says how to write it.
        let m = parse_err("[device.c.img]\ntype = \"file\"\npath = \"c.img\"\n");
        assert_names(&m, "c", "'type'");
        assert!(m.contains("[device.\"c.img\"]"), "{m}");
    }

    #[test]
    fn missing_size() {
        for kind in ["mem", "null"] {
            let m = parse_err(&format!("[device.d0]\ntype = \"{kind}\"\nblock = 512\n"));
            assert_names(&m, "d0", "'size'");
        }
    }

    #[test]
    fn missing_path() {
        let m = parse_err("[device.f]\ntype = \"file\"\nsize = \"1M\"\n");
        assert_names(&m, "f", "'path'");
    }

    #[test]
    fn missing_members() {
        for kind in ["linear", "stripe", "mirror", "raid10"] {
            let m = parse_err(&format!("{}[device.top]\ntype = \"{kind}\"\n", mems(2)));
            assert_names(&m, "top", "'members'");
        }
    }

    #[test]
    fn file_keys_of_the_wrong_kind() {
        let base = "[device.f]\ntype = \"file\"\npath = \"/dev/shm/x\"\nsize = \"1M\"\n";
        for (line, key) in [
            ("engine = \"spdk\"", "'engine'"),
            ("engine = 1", "'engine'"),
            ("direct = \"yes\"", "'direct'"),
            ("direct = 2", "'direct'"),
        ] {
            let m = parse_err(&format!("{base}{line}\n"));
            assert_names(&m, "f", key);
        }
        let m = parse_err("[device.f]\ntype = \"file\"\npath = 7\n");
        assert_names(&m, "f", "'path'");
    }
}

mod members {
    use super::*;

    #[test]
    fn members_not_a_list() {
        for value in ["\"d0\"", "3", "{ a = \"d0\" }", "[1, 2]", "[\"d0\", 1]"] {
            let m = parse_err(&format!(
                "{}[device.top]\ntype = \"linear\"\nmembers = {value}\n",
                mems(2)
            ));
            assert_names(&m, "top", "'members'");
        }
    }

    #[test]
    fn members_empty() {
        for kind in ["linear", "stripe", "mirror", "raid10"] {
            let m = parse_err(&format!(
                "{}[device.top]\ntype = \"{kind}\"\nmembers = []\n",
                mems(2)
            ));
            assert_names(&m, "top", "'members'");
        }
    }

    #[test]
    fn member_not_defined() {
        let m = parse_err(&format!(
            "{}[device.top]\ntype = \"stripe\"\nmembers = [\"d0\", \"d9\"]\n",
            mems(2)
        ));
        assert_names(&m, "top", "'members'");
        assert!(m.contains("'d9'"), "{m}");
    }

    #[test]
    fn member_named_twice_in_one_list() {
        let m = parse_err(&format!(
            "{}[device.top]\ntype = \"mirror\"\nmembers = [\"d0\", \"d1\", \"d0\"]\n",
            mems(2)
        ));
        assert_names(&m, "top", "'members'");
        assert!(m.contains("'d0'"), "{m}");
    }

    #[test]
    fn device_used_by_two_devices() {
        let m = parse_err(&format!(
            "{}[device.a]\ntype = \"linear\"\nmembers = [\"d0\", \"d1\"]\n\n\
             [device.b]\ntype = \"mirror\"\nmembers = [\"d2\", \"d0\"]\n",
            mems(3)
        ));
        assert_names(&m, "d0", "members");
        assert!(m.contains("'a'") && m.contains("'b'"), "{m}");
    }

    #[test]
    fn device_that_is_its_own_member() {
        let m = parse_err(&format!(
            "{}[device.top]\ntype = \"linear\"\nmembers = [\"d0\", \"top\"]\n",
            mems(1)
        ));
        assert_names(&m, "top", "'members'");
    }

    #[test]
    fn cycle_of_two() {
        let m = parse_err(&format!(
            "{}[device.a]\ntype = \"linear\"\nmembers = [\"d0\", \"b\"]\n\n\
             [device.b]\ntype = \"linear\"\nmembers = [\"a\"]\n",
            mems(1)
        ));
        assert!(m.contains("cycle"), "{m}");
        assert_names(&m, "a", "members");
        assert_names(&m, "b", "members");
    }

    #[test]
    fn cycle_of_three() {
        let m = parse_err(
            "[device.a]\ntype = \"linear\"\nmembers = [\"b\"]\n\n\
             [device.b]\ntype = \"mirror\"\nmembers = [\"c\", \"x\"]\n\n\
             [device.c]\ntype = \"linear\"\nmembers = [\"a\"]\n\n\
             [device.x]\ntype = \"mem\"\nsize = \"1M\"\n",
        );
        assert!(m.contains("cycle"), "{m}");
        for device in ["a", "b", "c"] {
            assert_names(&m, device, "members");
        }
        assert!(!m.contains("'x'"), "x is not in the cycle: {m}");
    }

    #[test]
    fn mirror_with_one_member() {
        let m = open_err(
            &format!(
                "{}[device.m]\ntype = \"mirror\"\nmembers = [\"d0\"]\n",
                mems(1)
            ),
            "m",
        );
        assert_names(&m, "m", "members");
    }

    #[test]
    fn stripe_and_raid10_members_too_small_for_one_chunk() {
        // 32 KiB for data on each member, 64 KiB chunks: 32 KiB members in the raw
        // layout, and 1 MiB + 32 KiB ones with superblocks (the metadata area takes 1 MiB).
        for (size, metadata) in [("32K", "metadata = \"none\"\n"), ("1056K", "")] {
            for (kind, n) in [("stripe", 2), ("raid10", 2), ("raid10", 4)] {
                let members: String = (0..n)
                    .map(|i| format!("[device.d{i}]\ntype = \"mem\"\nsize = \"{size}\"\n\n"))
                    .collect();
                let text = format!(
                    "{members}[device.top]\ntype = \"{kind}\"\nmembers = {}\nchunk = \"64K\"\n{metadata}",
                    list(n)
                );
                let m = open_err(&text, "top");
                assert_names(&m, "top", "members");
                assert!(m.contains("chunk"), "{m}");
            }
        }
    }

    #[test]
    fn one_small_member_is_enough_to_refuse() {
        // The smallest member decides: three of 1 MiB and one of 16 KiB, in the raw layout.
        let text = format!(
            "{}[device.d3]\ntype = \"mem\"\nsize = \"16K\"\n\n\
             [device.top]\ntype = \"stripe\"\nmembers = {}\nchunk = \"64K\"\nmetadata = \"none\"\n",
            mems(3),
            list(4)
        );
        assert_names(&open_err(&text, "top"), "top", "members");
        // With superblocks (the default), a member smaller than the metadata area is
        // refused by name.
        let members: String = (0..3)
            .map(|i| format!("[device.d{i}]\ntype = \"mem\"\nsize = \"2M\"\n\n"))
            .collect();
        let text = format!(
            "{members}[device.d3]\ntype = \"mem\"\nsize = \"16K\"\n\n\
             [device.top]\ntype = \"stripe\"\nmembers = {}\nchunk = \"64K\"\n",
            list(4)
        );
        let m = open_err(&text, "top");
        assert_names(&m, "top", "metadata area");
        assert!(m.contains("'d3'"), "names the member: {m}");
    }
}

mod chunk {
    use super::*;

    #[test]
    fn chunk_not_a_power_of_two() {
        for kind in ["stripe", "raid10"] {
            for chunk in ["\"3000\"", "\"48K\"", "\"0\"", "12288"] {
                let m = parse_err(&format!(
                    "{}[device.top]\ntype = \"{kind}\"\nmembers = {}\nchunk = {chunk}\n",
                    mems(4),
                    list(4)
                ));
                assert_names(&m, "top", "'chunk'");
            }
        }
    }

    #[test]
    fn chunk_smaller_than_the_block_size() {
        // 256-byte chunks under 512-byte blocks, and 2 KiB chunks under 4 KiB blocks.
        for kind in ["stripe", "raid10"] {
            let text = format!(
                "{}[device.top]\ntype = \"{kind}\"\nmembers = {}\nchunk = \"256\"\n",
                mems(4),
                list(4)
            );
            assert_names(&open_err(&text, "top"), "top", "chunk");
            let members: String = (0..4)
                .map(|i| {
                    format!("[device.d{i}]\ntype = \"mem\"\nsize = \"2M\"\nblock = \"4K\"\n\n")
                })
                .collect();
            let text = format!(
                "{members}[device.top]\ntype = \"{kind}\"\nmembers = {}\nchunk = \"2K\"\n",
                list(4)
            );
            let m = open_err(&text, "top");
            assert_names(&m, "top", "chunk");
            assert!(m.contains("4096"), "names the block size: {m}");
        }
    }

    #[test]
    fn chunk_not_a_size() {
        let m = parse_err(&format!(
            "{}[device.top]\ntype = \"stripe\"\nmembers = {}\nchunk = \"64Q\"\n",
            mems(2),
            list(2)
        ));
        assert_names(&m, "top", "'chunk'");
    }
}

mod copies {
    use super::*;

    fn raid10(members: usize, copies: &str) -> String {
        format!(
            "{}[device.r]\ntype = \"raid10\"\nmembers = {}\ncopies = {copies}\n",
            mems(members),
            list(members)
        )
    }

    #[test]
    fn raid10_copies_one() {
        assert_names(&open_err(&raid10(4, "1"), "r"), "r", "copies");
        assert_names(&open_err(&raid10(4, "0"), "r"), "r", "copies");
    }

    #[test]
    fn raid10_copies_more_than_members() {
        let m = open_err(&raid10(4, "5"), "r");
        assert_names(&m, "r", "copies");
        assert_names(&open_err(&raid10(2, "3"), "r"), "r", "copies");
        // As many copies as members is allowed: every member holds everything (2 MiB
        // members, 1 MiB of them for data).
        let text = raid10(3, "3").replace("\"1M\"", "\"2M\"");
        let file = StackFile::parse(&text).unwrap();
        assert_eq!(file.open("r").unwrap().geometry().size_bytes, 1 << 20);
    }

    #[test]
    fn raid10_copies_not_a_number() {
        for copies in ["-1", "\"two\"", "2.5", "true"] {
            assert_names(&parse_err(&raid10(4, copies)), "r", "'copies'");
        }
    }
}

mod sizes {
    use super::*;

    #[test]
    fn bad_size_strings() {
        for size in [
            "\"1x\"",
            "\"lots\"",
            "\"-4k\"",
            "\"1.5G\"",
            "\"\"",
            "\"99999999999999999999\"",
            "-1",
            "0",
            "1.5",
            "true",
            "[1]",
        ] {
            for kind in ["mem", "null"] {
                let m = parse_err(&format!("[device.d0]\ntype = \"{kind}\"\nsize = {size}\n"));
                assert_names(&m, "d0", "'size'");
            }
        }
        let m = parse_err("[device.f]\ntype = \"file\"\npath = \"/dev/shm/x\"\nsize = \"9Z\"\n");
        assert_names(&m, "f", "'size'");
        assert!(m.contains("9Z"), "quotes the input: {m}");
    }

    #[test]
    fn sizes_a_device_cannot_have() {
        // These parse as sizes but the device refuses them when it opens.
        for (line, key) in [
            ("size = \"0\"", "size"),
            ("size = \"1000\"", "size"),
            ("size = \"1M\"\nblock = \"1000\"", "block"),
            ("size = \"1M\"\nblock = \"256\"", "block"),
            ("size = \"1M\"\nblock = \"128K\"", "block"),
        ] {
            let m = open_err(&format!("[device.d0]\ntype = \"mem\"\n{line}\n"), "d0");
            assert_names(&m, "d0", key);
        }
        let m = parse_err("[device.d0]\ntype = \"mem\"\nsize = \"1M\"\nblock = \"8G\"\n");
        assert_names(&m, "d0", "'block'");
    }

    #[test]
    fn a_bad_member_is_named_when_opening_the_top() {
        let text = format!(
            "{}[device.d1]\ntype = \"mem\"\nsize = \"1000\"\n\n\
             [device.top]\ntype = \"linear\"\nmembers = [\"d0\", \"d1\"]\n",
            mems(1)
        );
        assert_names(&open_err(&text, "top"), "d1", "size");
    }
}

mod file_members {
    use super::*;

    #[test]
    fn a_file_that_does_not_exist_without_size() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("absent.img");
        let text = format!(
            "[device.f]\ntype = \"file\"\npath = \"{}\"\n\n{}\
             [device.m]\ntype = \"mirror\"\nmembers = [\"f\", \"d0\"]\n",
            path.display(),
            mems(1)
        );
        for name in ["f", "m"] {
            let m = open_err(&text, name);
            assert_names(&m, "f", "size");
            assert!(m.contains("absent.img"), "names the path: {m}");
        }
        assert!(!path.exists(), "nothing was created");
    }

    #[test]
    fn a_file_that_cannot_be_created() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("no-such-dir").join("d.img");
        let text = format!(
            "[device.f]\ntype = \"file\"\npath = \"{}\"\nsize = \"1M\"\n\n{}\
             [device.top]\ntype = \"linear\"\nmembers = [\"d0\", \"f\"]\n",
            path.display(),
            mems(1)
        );
        for name in ["f", "top"] {
            let m = open_err(&text, name);
            assert_names(&m, "f", &path.display().to_string());
        }
    }
}

mod file_level {
    use super::*;

    #[test]
    fn unknown_tuning_key() {
        let m = parse_err(&format!("[tuning]\nclocks = \"cached\"\n\n{}", mem("d0")));
        assert!(m.contains("tuning") && m.contains("'clocks'"), "{m}");
        let m = parse_err(&format!("[tuning]\nclock = 1\n\n{}", mem("d0")));
        assert!(m.contains("tuning") && m.contains("'clock'"), "{m}");
        // A value the switch does not have is refused when the file is read, not later.
        let m = parse_err(&format!("[tuning]\nflush = \"sometimes\"\n\n{}", mem("d0")));
        assert!(
            m.contains("tuning") && m.contains("flush") && m.contains("batched, serial"),
            "{m}"
        );
        let m = parse_err(&format!("[tuning]\ncoalesce = \"yes\"\n\n{}", mem("d0")));
        assert!(m.contains("coalesce") && m.contains("on, off"), "{m}");
    }

    #[test]
    fn unknown_top_level_key() {
        for (text, key) in [
            (
                "[devices.d0]\ntype = \"mem\"\nsize = \"1M\"\n".to_string(),
                "'devices'",
            ),
            (format!("name = \"x\"\n{}", mem("d0")), "'name'"),
            (
                format!("[tunings]\nclock = \"cached\"\n\n{}", mem("d0")),
                "'tunings'",
            ),
            (format!("tuning = \"fast\"\n{}", mem("d0")), "'tuning'"),
        ] {
            let m = parse_err(&text);
            assert!(m.contains(key), "{m}");
        }
    }

    #[test]
    fn invalid_toml() {
        for text in [
            "[device.d0\ntype = \"mem\"\n",
            "[device.d0]\ntype = mem\n",
            "[device.d0]\ntype = \"mem\"\ntype = \"null\"\nsize = \"1M\"\n",
            // The same device twice.
            "[device.d0]\ntype = \"mem\"\nsize = \"1M\"\n[device.d0]\ntype = \"mem\"\nsize = \"1M\"\n",
            "\u{0}",
        ] {
            let m = parse_err(text);
            assert!(m.contains("TOML"), "{m}");
            assert_eq!(m.lines().count(), 1, "one line: {m:?}");
        }
        // The line where the parser stopped.
        let m = parse_err("[device.d0]\ntype = \"mem\"\nsize = 1M\n");
        assert!(m.contains("line 3"), "{m}");
    }

    #[test]
    fn a_device_that_is_not_a_table() {
        let m = parse_err("[device]\nd0 = \"mem:1M\"\n");
        assert!(m.contains("'d0'"), "{m}");
    }

    #[test]
    fn no_devices_at_all() {
        for text in [
            "",
            "# nothing\n",
            "[tuning]\nclock = \"cached\"\n",
            "[device]\n",
        ] {
            let m = parse_err(text);
            assert!(m.contains("device"), "{text:?}: {m}");
        }
    }
}

mod pick {
    use super::*;

    #[test]
    fn several_roots_without_a_name() {
        let text = format!(
            "{}[device.a]\ntype = \"linear\"\nmembers = [\"d0\"]\n\n\
             [device.b]\ntype = \"mirror\"\nmembers = [\"d1\", \"d2\"]\n",
            mems(4)
        );
        let file = StackFile::parse(&text).unwrap();
        assert_eq!(file.roots(), ["a", "b", "d3"]);
        let m = file.pick(None).unwrap_err().to_string();
        for root in ["a", "b", "d3"] {
            assert!(m.contains(root), "names root {root}: {m}");
        }
        assert!(m.contains("--device"), "{m}");
        assert!(
            !m.contains("d0") && !m.contains("d1"),
            "members are not roots: {m}"
        );
        assert_eq!(file.pick(Some("b")).unwrap(), "b");
        assert_eq!(file.pick(Some("d0")).unwrap(), "d0");
    }

    #[test]
    fn unknown_name() {
        let file = StackFile::parse(&mems(2)).unwrap();
        let m = file.pick(Some("d7")).unwrap_err().to_string();
        assert!(m.contains("'d7'"), "{m}");
        assert!(file.open("d7").is_err());
    }

    #[test]
    fn a_single_leaf_is_the_root() {
        let file = StackFile::parse(&mem("only")).unwrap();
        assert_eq!(file.pick(None).unwrap(), "only");
    }
}

mod regressions {
    use cairn_config::StackFile;
    use cairn_core::blocking::BlockingQueue;
    use cairn_core::{IoFlags, Switches};

    /// Threads of this process whose name starts with `prefix` (Linux cuts names to 15
    /// bytes).
    fn threads_named(prefix: &str) -> usize {
        std::fs::read_dir("/proc/self/task")
            .map(|d| {
                d.flatten()
                    .filter(|t| {
                        std::fs::read_to_string(t.path().join("comm"))
                            .is_ok_and(|c| c.starts_with(prefix))
                    })
                    .count()
            })
            .unwrap_or(0)
    }

    /// With `--dispatch handoff`, every member queue has a worker thread; closing the
    /// queue must end it. Workers used to notice a closed queue only on their next
    /// 100 ms wake-up, then drained for their full 5 s deadline because they always
    /// called themselves busy: the stack file fuzzer saw 1,300 of them alive at once.
    #[test]
    fn handoff_workers_end_with_their_queues() {
        let text = "[device.Zm]\ntype = \"mem\"\nsize = \"2M\"\n\
                    [device.Zl]\ntype = \"linear\"\nmembers = [\"Zm\"]\n";
        let device = StackFile::parse(text).unwrap().open("Zl").unwrap();
        let switches = Switches {
            dispatch: cairn_core::DispatchMode::Handoff,
            ..Switches::default()
        };
        let queues: Vec<BlockingQueue> = (0..20)
            .map(|_| {
                let q = BlockingQueue::open(&device, switches).unwrap();
                q.write(0, &[7u8; 4096], IoFlags::default()).unwrap();
                q
            })
            .collect();
        assert_eq!(threads_named("cairn-handoff-Z"), 20);
        // Let every worker go to sleep on its wake-up, as an idle one does.
        std::thread::sleep(std::time::Duration::from_millis(100));
        drop(queues);
        // Workers exit once they see their channel closed; give them a bounded while.
        let mut left = threads_named("cairn-handoff-Z");
        for _ in 0..200 {
            if left == 0 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
            left = threads_named("cairn-handoff-Z");
        }
        assert_eq!(
            left, 0,
            "worker threads still running after their queues closed"
        );
    }

    #[test]
    fn mirror_with_more_copies_than_tracked_is_refused_not_a_panic() {
        let mut text = String::new();
        let mut names = Vec::new();
        for i in 0..33 {
            text += &format!("[device.m{i}]\ntype = \"mem\"\nsize = \"1M\"\n");
            names.push(format!("\"m{i}\""));
        }
        text += &format!(
            "[device.top]\ntype = \"mirror\"\nmembers = [{}]\n",
            names.join(", ")
        );
        // Refused when the file is read, before any device is built.
        let err = StackFile::parse(&text)
            .expect_err("33 copies must be refused")
            .to_string();
        assert!(err.contains("'top'") && err.contains("32"), "{err}");
    }

    #[test]
    fn linear_uses_members_in_whole_blocks_of_the_stack() {
        // A 1.5 KiB member of 512-byte blocks then members of 4 KiB blocks: the stack has
        // 4 KiB blocks, and no piece may straddle one (an O_DIRECT member would refuse it).
        // In the raw layout, and with superblocks: the same sizes after a 1 MiB metadata
        // area on each member.
        const MIB: u64 = 1 << 20;
        for (data_offset, metadata) in [(0, "metadata = \"none\"\n"), (MIB, "")] {
            let size = |bytes: u64| data_offset + bytes;
            let text = format!(
                "[device.a]\ntype = \"mem\"\nsize = {}\n\
                 [device.b]\ntype = \"mem\"\nsize = {}\nblock = \"4K\"\n\
                 [device.c]\ntype = \"mem\"\nsize = {}\nblock = \"4K\"\n\
                 [device.top]\ntype = \"linear\"\nmembers = [\"a\", \"b\", \"c\"]\n{metadata}",
                size(1536),
                size(8192),
                size(4096)
            );
            let top = StackFile::parse(&text).unwrap().open("top").unwrap();
            let g = top.geometry();
            assert_eq!((g.block_bytes, g.size_bytes), (4096, 12288), "{metadata}");
            let q = BlockingQueue::open(&top, Switches::default()).unwrap();
            let data: Vec<u8> = (0..12288).map(|i| (i % 251) as u8).collect();
            q.write(0, &data, IoFlags::NONE).unwrap();
            let mut back = vec![0u8; 12288];
            q.read(0, &mut back).unwrap();
            assert_eq!(back, data, "{metadata}");
            // Member b received whole blocks starting where its data starts.
            let b = &top.children()[1];
            let qb = BlockingQueue::open(b, Switches::default()).unwrap();
            let mut first = vec![0u8; 4096];
            qb.read(data_offset, &mut first).unwrap();
            assert_eq!(first, data[..4096], "{metadata}");
        }
    }
}

mod exports {
    use super::*;

    fn with(exports: &str) -> String {
        format!(
            "{}[device.s]\ntype = \"stripe\"\nmembers = [\"d0\", \"d1\"]\n\n{}{exports}",
            mems(2),
            mem("other")
        )
    }

    #[test]
    fn exports_parse_with_their_defaults() {
        let f = StackFile::parse(&with(
            "[export.a]\ndevice = \"s\"\n[export.b]\ndevice = \"other\"\nread_only = true\ndescription = \"spare\"\ndefault = true\n",
        ))
        .unwrap();
        assert!(!f.exports["a"].read_only && !f.exports["a"].default);
        assert!(f.exports["b"].read_only && f.exports["b"].default);
        assert_eq!(f.exports["b"].description, "spare");
    }

    #[test]
    fn every_export_mistake_names_the_export_and_key() {
        for (text, export, key) in [
            (
                "[export.a]\ndevice = \"s\"\nreadonly = true\n",
                "a",
                "readonly",
            ),
            ("[export.a]\nread_only = true\n", "a", "device"),
            ("[export.a]\ndevice = \"nope\"\n", "a", "device"),
            ("[export.a]\ndevice = \"d0\"\n", "a", "device"),
            ("[export.a]\ndevice = 3\n", "a", "device"),
            (
                "[export.a]\ndevice = \"s\"\nread_only = \"yes\"\n",
                "a",
                "read_only",
            ),
        ] {
            let e = parse_err(&with(text));
            assert!(
                e.contains(&format!("export '{export}'")) && e.contains(key),
                "{text}: {e}"
            );
        }
        let e = parse_err(&with(
            "[export.a]\ndevice = \"s\"\ndefault = true\n[export.b]\ndevice = \"other\"\ndefault = true\n",
        ));
        assert!(
            e.contains("'a'") && e.contains("'b'") && e.contains("default"),
            "{e}"
        );
    }
}
