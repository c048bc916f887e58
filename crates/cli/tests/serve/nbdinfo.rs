use super::*;

#[test]
fn json_reports_size_flags_block_sizes_and_base_allocation() {
    const NAME: &str = "nbdinfo::json_reports_size_flags_block_sizes_and_base_allocation";
    let Some([nbdinfo]) = tools(NAME, ["nbdinfo"]) else {
        return;
    };
    let srv = Server::start(&["--device", "mem:64M"]);
    let out = success(
        "nbdinfo --json",
        &run(Command::new(&nbdinfo).args(["--json", &srv.uri()])),
    );
    let json: Value = serde_json::from_str(&out)
        .unwrap_or_else(|e| panic!("nbdinfo --json is not JSON ({e}): {out}"));
    assert_eq!(json["protocol"], "newstyle-fixed", "{json:#}");
    assert_eq!(json["structured"], true, "{json:#}");
    let e = &json["exports"][0];
    assert_eq!(e["export-size"], 64u64 << 20, "{json:#}");
    assert_eq!(e["is_read_only"], false, "{json:#}");
    for key in [
        "can_flush",
        "can_trim",
        "can_zero",
        "can_fua",
        "can_multi_conn",
        "can_df",
        "can_fast_zero",
        "can_cache",
    ] {
        assert_eq!(e[key], true, "{key}: {json:#}");
    }
    // Any byte is served (read-modify-write), so the minimum is 1.
    assert_eq!(e["block_size_minimum"], 1, "{json:#}");
    assert_eq!(e["block_size_preferred"], 4096, "{json:#}");
    assert_eq!(e["block_size_maximum"], 67_108_864, "{json:#}");
    let contexts: Vec<&str> = e["contexts"]
        .as_array()
        .unwrap_or_else(|| panic!("no contexts: {json:#}"))
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(contexts.contains(&"base:allocation"), "{json:#}");
    // `--can` and `--is` answer with exit status 0 (true) or 2 (false).
    let can = |what: &[&str], uri: &str| {
        run(Command::new(&nbdinfo).args(what).arg(uri))
            .status
            .code()
    };
    for c in [
        "flush",
        "trim",
        "zero",
        "fua",
        "multi-conn",
        "df",
        "fast-zero",
        "cache",
    ] {
        assert_eq!(can(&["--can", c], &srv.uri()), Some(0), "--can {c}");
    }
    assert_eq!(can(&["--is", "read-only"], &srv.uri()), Some(2));
    assert_eq!(can(&["--can", "write"], &srv.uri()), Some(0));

    // A read-only export: no writes, trims or zeroes, but flush and multi-conn.
    let ro = Server::start(&["--device", "mem:16M", "--read-only"]);
    assert_eq!(can(&["--is", "read-only"], &ro.uri()), Some(0));
    for c in ["write", "trim", "zero", "fua", "fast-zero"] {
        assert_eq!(
            can(&["--can", c], &ro.uri()),
            Some(2),
            "read-only --can {c}"
        );
    }
    for c in ["flush", "multi-conn"] {
        assert_eq!(
            can(&["--can", c], &ro.uri()),
            Some(0),
            "read-only --can {c}"
        );
    }
}

/// Block status after a write-zeroes with NO_HOLE: allocated zeroes (NBD_STATE_ZERO, 2;
/// it said data, 0), then data where a write put bytes; a plain write-zeroes is a hole
/// (3). Through `cairn serve` of a mem export, with Python libnbd.
const NO_HOLE: &str = r#"
import os
import nbd

h = nbd.NBD()
h.add_meta_context("base:allocation")
h.connect_unix(os.environ["CAIRN_SOCK"])
h.pwrite(b"\x5a" * (1 << 20), 0)
h.zero(256 << 10, 0, nbd.CMD_FLAG_NO_HOLE)
h.zero(64 << 10, 512 << 10)
h.pwrite(b"\x01" * 4096, 128 << 10)

def status():
    found = []
    def cb(meta, offset, entries, err):
        if meta == "base:allocation":
            for i in range(0, len(entries), 2):
                found.append((entries[i], entries[i + 1]))
    h.block_status(1 << 20, 0, cb)
    return found

want = [(128 << 10, 2), (4 << 10, 0), (124 << 10, 2), (256 << 10, 0), (64 << 10, 3),
        (448 << 10, 0)]
got = status()
if got != want:
    raise SystemExit(f"block status {got}, want {want}")
if h.pread(4096, 0) != bytes(4096) or h.pread(1, 128 << 10) != b"\x01":
    raise SystemExit("the data read back is wrong")
print("zeroes reported")
"#;

#[test]
fn a_no_hole_write_zeroes_is_reported_as_zeroes() {
    const NAME: &str = "nbdinfo::a_no_hole_write_zeroes_is_reported_as_zeroes";
    let Some(python) = python_with_libnbd(NAME) else {
        return;
    };
    let srv = Server::start(&["--device", "mem:4M,block=4096"]);
    libnbd_script(&python, NO_HOLE, &srv.sock, &[], "zeroes reported");
}

#[test]
fn map_covers_the_export_and_never_claims_zeroes_over_data() {
    const NAME: &str = "nbdinfo::map_covers_the_export_and_never_claims_zeroes_over_data";
    let Some([nbdinfo]) = tools(NAME, ["nbdinfo"]) else {
        return;
    };
    const SIZE: u64 = 16 << 20;
    let srv = Server::start(&["--device", "mem:16M"]);
    let map = |srv: &Server| -> Vec<(u64, u64, u64)> {
        let (runs, out) = map_runs(&nbdinfo, &srv.uri());
        // Contiguous from 0 to the end of the export.
        let mut at = 0;
        for &(offset, length, _) in &runs {
            assert_eq!(offset, at, "runs must be contiguous: {out}");
            assert!(length > 0, "{out}");
            at += length;
        }
        assert_eq!(at, SIZE, "the map must end at the export size: {out}");
        runs
    };
    // A fresh sparse RAM disk is one hole that reads as zeroes.
    assert_eq!(map(&srv), vec![(0, SIZE, 3)]);

    // Data at [3M, 4M): no run over it may claim zeroes (bit 1) or a hole (bit 0).
    let (mut c, _, _) = Raw::go(&srv.sock, "");
    c.write_ok(1, 0, 3 << 20, &random_bytes(1 << 20, 7));
    let runs = map(&srv);
    for &(offset, length, kind) in &runs {
        if offset < 4 << 20 && offset + length > 3 << 20 {
            assert_eq!(kind & 3, 0, "data reported as hole or zero: {runs:?}");
        }
    }
    assert!(
        runs.iter().any(|&(_, _, kind)| kind == 3),
        "the unwritten rest should still be a hole: {runs:?}"
    );
    // Exactly [3M, 4M) is data (pages, not 2 MiB regions), and a trim of its first
    // half turns that half back into a hole, as nbdkit's memory plugin reports it.
    assert_eq!(
        runs,
        vec![
            (0, 3 << 20, 3),
            (3 << 20, 1 << 20, 0),
            (4 << 20, SIZE - (4 << 20), 3)
        ]
    );
    c.request(0, CMD_TRIM, 2, 3 << 20, 512 << 10, &[]).unwrap();
    c.expect(2, 0);
    assert_eq!(
        map(&srv),
        vec![
            (0, (3 << 20) + (512 << 10), 3),
            ((3 << 20) + (512 << 10), 512 << 10, 0),
            (4 << 20, SIZE - (4 << 20), 3)
        ]
    );
    c.disconnect();
    // qemu-img map says the same.
    let Some([qemu_img]) = tools(NAME, ["qemu-img"]) else {
        return;
    };
    let out = success(
        "qemu-img map",
        &run(Command::new(&qemu_img).args(["map", "--output=json", "-f", "raw", &srv.uri()])),
    );
    let json: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    let data: Vec<(u64, u64)> = json
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["data"] == true)
        .map(|r| (r["start"].as_u64().unwrap(), r["length"].as_u64().unwrap()))
        .collect();
    assert_eq!(data, vec![((3 << 20) + (512 << 10), 512 << 10)], "{out}");
}

/// `--read-only` makes every export of a stack file read-only, whatever its table says
/// (it was refused with export tables, and said "with --device" only).
#[test]
fn read_only_covers_every_export_of_a_stack_file() {
    const NAME: &str = "nbdinfo::read_only_covers_every_export_of_a_stack_file";
    let Some([nbdinfo]) = tools(NAME, ["nbdinfo"]) else {
        return;
    };
    let dir = tmpdir();
    let stack = write_stack(
        &dir,
        "[device.a]\ntype = \"mem\"\nsize = \"8M\"\n\n\
         [export.alpha]\ndevice = \"a\"\nread_only = false\n\n\
         [export.beta]\ndevice = \"a\"\n",
    );
    let srv = Server::start_in(dir, &[path_str(&stack), "--read-only"]);
    let out = success(
        "nbdinfo --list --json",
        &run(Command::new(&nbdinfo).args(["--list", "--json", &srv.uri()])),
    );
    let json: Value = serde_json::from_str(&out).expect("JSON");
    let exports = json["exports"].as_array().expect("exports");
    assert_eq!(exports.len(), 2, "{out}");
    for e in exports {
        assert_eq!(e["is_read_only"], true, "{out}");
    }
}

#[test]
fn list_names_every_export_with_its_description() {
    const NAME: &str = "nbdinfo::list_names_every_export_with_its_description";
    let Some([nbdinfo]) = tools(NAME, ["nbdinfo"]) else {
        return;
    };
    let dir = tmpdir();
    let stack = write_stack(
            &dir,
            "[device.a]\ntype = \"mem\"\nsize = \"8M\"\n\n\
             [device.b]\ntype = \"mem\"\nsize = \"16M\"\n\n\
             [export.alpha]\ndevice = \"a\"\ndescription = \"the first disk\"\ndefault = true\n\n\
             [export.beta]\ndevice = \"b\"\nread_only = true\ndescription = \"the second, read-only\"\n",
        );
    let srv = Server::start_in(dir, &[path_str(&stack)]);
    let out = success(
        "nbdinfo --list --json",
        &run(Command::new(&nbdinfo).args(["--list", "--json", &srv.uri()])),
    );
    let json: Value = serde_json::from_str(&out)
        .unwrap_or_else(|e| panic!("nbdinfo --list --json is not JSON ({e}): {out}"));
    let exports = json["exports"].as_array().expect("exports");
    let found: Vec<(&str, &str, u64, bool)> = exports
        .iter()
        .map(|e| {
            (
                e["export-name"].as_str().unwrap(),
                e["description"].as_str().unwrap_or(""),
                e["export-size"].as_u64().unwrap(),
                e["is_read_only"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        found,
        vec![
            ("alpha", "the first disk", 8 << 20, false),
            ("beta", "the second, read-only", 16 << 20, true),
        ],
        "{out}"
    );
    // The plain listing shows the names and descriptions too.
    let plain = success(
        "nbdinfo --list",
        &run(Command::new(&nbdinfo).args(["--list", &srv.uri()])),
    );
    for s in [
        "export=\"alpha\"",
        "the first disk",
        "export=\"beta\"",
        "the second, read-only",
    ] {
        assert!(plain.contains(s), "{s:?} not in:\n{plain}");
    }
    // The empty name picks the default export; names pick theirs.
    let size = |uri: &str| {
        let out = success(
            "nbdinfo --size",
            &run(Command::new(&nbdinfo).args(["--size", uri])),
        );
        out.trim().parse::<u64>().unwrap()
    };
    assert_eq!(size(&srv.uri()), 8 << 20);
    assert_eq!(size(&srv.uri_for("beta")), 16 << 20);
    // An unknown name fails (and says which).
    let out = run(Command::new(&nbdinfo).arg(srv.uri_for("nope")));
    assert!(!out.status.success(), "nbdinfo on export 'nope' succeeded");
    assert!(text(&out.stderr).contains("nope"), "{}", text(&out.stderr));
}

#[test]
fn tcp_port_0_listens_on_the_port_the_ready_line_names() {
    const NAME: &str = "nbdinfo::tcp_port_0_listens_on_the_port_the_ready_line_names";
    let Some([nbdinfo]) = tools(NAME, ["nbdinfo"]) else {
        return;
    };
    let dir = tmpdir();
    let none = dir.path().join("no.sock");
    let srv = Server::spawn(
        dir,
        none,
        &["--listen", "tcp:127.0.0.1:0"],
        &["--device", "mem:16M"],
    );
    assert_eq!(srv.addrs.len(), 1, "{:?}", srv.addrs);
    let port: u16 = srv.addrs[0]
        .strip_prefix("tcp:127.0.0.1:")
        .unwrap_or_else(|| panic!("ready line address {:?}", srv.addrs))
        .parse()
        .expect("a port number");
    assert_ne!(port, 0, "the ready line must show the bound port");
    let out = success(
        "nbdinfo --size over TCP",
        &run(Command::new(&nbdinfo).args(["--size", &format!("nbd://127.0.0.1:{port}/")])),
    );
    assert_eq!(out.trim(), (16u64 << 20).to_string());
}
