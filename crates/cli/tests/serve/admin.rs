use super::*;

pub(super) fn admin(sock: &Path, words: &[&str]) -> Output {
    run(Command::new(env!("CARGO_BIN_EXE_cairn"))
        .arg("admin")
        .arg(sock)
        .args(words))
}

/// Asserts that admin command `words` fails, saying `why`.
#[track_caller]
pub(super) fn refused(sock: &Path, words: &[&str], why: &str) {
    let out = admin(sock, words);
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !out.status.success() && said.contains(why),
        "{words:?}: {said}"
    );
}

/// `status` prints the device tree with sizes, health and what caches wrote back,
/// then the arrays; `status --json` gives the same for scripts; a raid10 member that
/// fails shows as degraded in both. The raid10 keeps superblocks (the default): 8 MiB
/// of data on each 9 MiB member.
#[test]
fn status_shows_the_tree_health_and_caches_and_json_for_scripts() {
    let dir = tmpdir();
    let ctl = dir.path().join("admin.sock");
    let mut t = String::new();
    for d in ["d0", "d1", "d2", "d3"] {
        t += &format!("[device.{d}]\ntype = \"mem\"\nsize = \"9M\"\n");
    }
    t += "[device.f3]\ntype = \"fault\"\nbase = \"d3\"\nfail = [\"write\"]\nafter_ios = 3\n\
              [device.r]\ntype = \"raid10\"\nmembers = [\"d0\", \"d1\", \"d2\", \"f3\"]\nchunk = \"64K\"\n\
              [device.c]\ntype = \"cache\"\nbase = \"r\"\nmemory = \"4M\"\n\
              [export.c]\ndevice = \"c\"\n";
    let stack = write_stack(&dir, &t);
    let srv = Server::start_in(dir, &[path_str(&stack), "--admin", path_str(&ctl)]);
    let (mut c, _, _) = Raw::go(&srv.sock, "c");
    for i in 0..64u64 {
        c.write_ok(i + 1, 0, i * 65536, &[i as u8; 65536]);
    }
    c.request(0, CMD_FLUSH, 999, 0, 0, &[]).unwrap();
    c.expect(999, 0);
    let out = success("status", &admin(&ctl, &["status"]));
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].starts_with("c (16MiB) write-back cache"), "{out}");
    assert!(lines[0].contains("written back"), "{out}");
    assert!(
        lines[1].starts_with("  r (16MiB) raid10 of 4 members"),
        "{out}"
    );
    assert!(lines[1].contains("[DEGRADED: failed f3]"), "{out}");
    assert!(
        lines.iter().any(|l| l.starts_with("    d0 (9MiB) mem")),
        "{out}"
    );
    assert!(
        lines.iter().any(|l| l.starts_with("      d3 (9MiB) mem")),
        "{out}"
    );
    // And the array's own lines, as /proc/mdstat shows md's.
    assert!(
        out.contains("r: raid10 of 4 members, 16MiB, metadata 1")
            && out.contains("[UUU_] d0 active, d1 active, d2 active, f3 failed"),
        "{out}"
    );
    let out = success("status --json", &admin(&ctl, &["status", "--json"]));
    let doc: serde_json::Value = serde_json::from_str(out.trim()).expect("JSON");
    let devices = doc["devices"].as_array().expect("devices");
    let r = devices.iter().find(|d| d["name"] == "r").expect("r");
    assert_eq!(r["size_bytes"], 16 << 20);
    assert_eq!(r["depth"], 1);
    assert_eq!(r["failed_members"], serde_json::json!(["f3"]));
    assert_eq!(r["children"], serde_json::json!(["d0", "d1", "d2", "f3"]));
    // The array as fields, not only as text.
    let arrays = doc["arrays"].as_array().expect("arrays");
    assert_eq!(arrays.len(), 1, "{doc:#}");
    let a = &arrays[0];
    assert_eq!(a["name"], "r");
    assert_eq!(a["level"], "raid10");
    assert_eq!(a["state"], "degraded");
    assert_eq!(a["degraded"], true);
    assert_eq!(a["copies"], 2);
    assert_eq!(a["size_bytes"], 16 << 20);
    assert!(a["events"].as_u64().unwrap() > 0, "{a:#}");
    assert_eq!(a["metadata"], 1);
    assert_eq!(a["uuid"].as_str().unwrap().len(), 36, "{a:#}");
    let states: Vec<(&str, &str, bool)> = a["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["name"].as_str().unwrap(),
                m["state"].as_str().unwrap(),
                m["readable"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        states,
        [
            ("d0", "active", true),
            ("d1", "active", true),
            ("d2", "active", true),
            ("f3", "failed", false)
        ],
        "{a:#}"
    );
    assert!(a["sync"].is_null(), "{a:#}");
    assert_eq!(a["bitmap"]["regions"], 1, "{a:#}");
    assert_eq!(a["bitmap"]["region_bytes"], 64 << 20, "{a:#}");
    let cache = devices.iter().find(|d| d["name"] == "c").expect("c");
    assert!(
        cache["written_back_bytes"].as_u64().unwrap() >= 4 << 20,
        "{cache}"
    );
    let out = admin(&ctl, &["status", "x"]);
    assert!(!out.status.success());
    c.disconnect();
}

/// A rebuild in progress shows in `status --json` as fields: the member being rebuilt,
/// the progress, the rate and the time left.
#[test]
fn a_rebuild_in_progress_is_in_status_json_as_fields() {
    let dir = tmpdir();
    let ctl = dir.path().join("admin.sock");
    let stack = write_stack(
        &dir,
        "[device.a]\ntype = \"mem\"\nsize = \"33M\"\n\
         [device.b]\ntype = \"mem\"\nsize = \"33M\"\n\
         [device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"b\"]\nrebuild_min = \"1M\"\nrebuild_max = \"2M\"\n",
    );
    let srv = Server::start_in(dir, &[path_str(&stack), "--admin", path_str(&ctl)]);
    success("fail", &admin(&ctl, &["fail", "m", "b"]));
    success("add", &admin(&ctl, &["add", "m", "mem:33M"]));
    let deadline = Instant::now() + IO_TIMEOUT;
    let a = loop {
        let out = success("status --json", &admin(&ctl, &["status", "--json"]));
        let doc: serde_json::Value = serde_json::from_str(out.trim()).expect("JSON");
        let a = doc["arrays"][0].clone();
        if a["sync"]["done_bytes"].as_u64().unwrap_or(0) > 0 {
            break a;
        }
        assert!(Instant::now() < deadline, "no rebuild progress: {a:#}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(a["state"], "rebuilding", "{a:#}");
    let sync = &a["sync"];
    assert_eq!(sync["kind"], "rebuild", "{a:#}");
    assert_eq!(sync["total_bytes"], 32 << 20, "{a:#}");
    assert!(sync["done_bytes"].as_u64().unwrap() < 32 << 20, "{a:#}");
    assert!(sync["rate_bytes_per_s"].as_u64().unwrap() > 0, "{a:#}");
    assert!(sync["percent"].as_f64().is_some(), "{a:#}");
    let members = a["members"].as_array().unwrap();
    assert_eq!(members[0]["state"], "active", "{a:#}");
    assert_eq!(members[1]["state"], "rebuilding", "{a:#}");
    assert_eq!(members[1]["role"], 1, "{a:#}");
    drop(srv);
}

/// A server without arrays says nothing of arrays or metadata (it ended with "no array
/// keeps metadata", a hint from before superblocks were the default).
#[test]
fn status_without_arrays_says_nothing_of_metadata() {
    let dir = tmpdir();
    let ctl = dir.path().join("admin.sock");
    let srv = Server::start_in(dir, &["--device", "mem:16M", "--admin", path_str(&ctl)]);
    let out = success("status", &admin(&ctl, &["status"]));
    assert!(!out.contains("metadata"), "{out}");
    assert!(out.contains("mem"), "{out}");
    drop(srv);
}

/// `power-cut` through the admin socket loses exactly what no flush made durable:
/// through a cache over a volatile mem, flushed and FUA writes survive, the rest is
/// gone, even when written before a FUA write. A bad command changes nothing.
#[test]
fn power_cut_loses_only_what_no_flush_made_durable() {
    let dir = tmpdir();
    let stack = write_stack(
        &dir,
        "[writeback]\nexpire = \"30s\"\ninterval = \"30s\"\n\
             [device.m]\ntype = \"mem\"\nsize = \"16M\"\nblock = 4096\nvolatile = true\n\
             [device.c]\ntype = \"cache\"\nbase = \"m\"\nmemory = \"8M\"\n",
    );
    let ctl = dir.path().join("admin.sock");
    let mut srv = Server::start_in(dir, &[path_str(&stack), "--admin", path_str(&ctl)]);
    let mode = std::fs::metadata(&ctl).unwrap().permissions();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
        0o600,
        "the admin socket is its owner's only"
    );
    let out = admin(&ctl, &["devices"]);
    assert_eq!(success("admin devices", &out), "c\n  m\n");

    let (mut c, _, _) = Raw::go(&srv.sock, "");
    let a = random_bytes(1 << 20, 31);
    let b = random_bytes(64 << 10, 32);
    let lost = random_bytes(256 << 10, 33);
    let fua = random_bytes(128 << 10, 34);
    c.write_ok(1, 0, 0, &a);
    c.request(0, CMD_FLUSH, 2, 0, 0, &[]).unwrap();
    c.expect(2, 0);
    c.write_ok(3, 0, 0, &b);
    c.write_ok(4, 0, 4 << 20, &lost);
    // Last: a FUA write makes its own range durable, not the writes before it.
    c.write_ok(5, FLAG_FUA, 8 << 20, &fua);

    // Mistakes: exit status 2, one line, nothing cut.
    for (words, needle) in [
        (vec!["power-cut", "c", "nosuch"], "no device 'nosuch'"),
        (vec!["explode"], "unknown command 'explode'"),
    ] {
        let out = admin(&ctl, &words);
        assert_eq!(out.status.code(), Some(2), "{words:?}");
        assert!(
            text(&out.stderr).contains(needle),
            "{words:?}: {}",
            text(&out.stderr)
        );
    }
    assert_same(
        "before the cut",
        &c.read_ok(6, 4 << 20, lost.len() as u32),
        &lost,
    );

    let out = admin(&ctl, &["power-cut"]);
    assert_eq!(success("admin power-cut", &out).trim(), "power cut: c");
    assert!(
        srv.wait_for_stderr("power cut of c", Duration::from_secs(5)),
        "{}",
        srv.stderr()
    );
    assert_same("flushed", &c.read_ok(7, 0, 1 << 20), &a);
    assert_same("FUA", &c.read_ok(8, 8 << 20, fua.len() as u32), &fua);
    assert_same(
        "never flushed",
        &c.read_ok(9, 4 << 20, lost.len() as u32),
        &vec![0u8; lost.len()],
    );
    // The device goes on working after the cut.
    c.write_ok(10, 0, 4 << 20, &b);
    assert_same("after the cut", &c.read_ok(11, 4 << 20, b.len() as u32), &b);
    c.disconnect();
    let (status, log) = srv.stop();
    assert!(status.success(), "exit status {status}; stderr:\n{log}");
    assert!(!ctl.exists(), "the admin socket is removed at exit");
}

/// A 4 KiB block carrying its page and version in a header (as `--verify` blocks
/// do), the rest derived from both, so that a read names the version it found and a
/// mix of two versions is caught.
pub(super) fn block(page: u64, version: u64) -> Vec<u8> {
    if version == 0 {
        return vec![0u8; 4096];
    }
    let mut b = page.to_le_bytes().to_vec();
    b.extend_from_slice(&version.to_le_bytes());
    b.extend_from_slice(&random_bytes(4096 - 16, page << 32 ^ version));
    b
}

/// The version `data` (read from `page`) holds; panics on anything else.
pub(super) fn version_of(page: u64, data: &[u8], what: &str) -> u64 {
    if data.iter().all(|&b| b == 0) {
        return 0;
    }
    let p = u64::from_le_bytes(data[..8].try_into().unwrap());
    let v = u64::from_le_bytes(data[8..16].try_into().unwrap());
    assert_eq!(p, page, "{what}: page {page} holds page {p}'s block");
    assert!(
        data == block(page, v),
        "{what}: page {page}: a torn or mixed block (header says version {v})"
    );
    v
}

/// The crash test end to end: a client pipelines random writes (some FUA) and
/// flushes to three exports while their power is cut through the admin socket at
/// random moments, writes in flight. After each cut every page must read back the
/// version a completed flush or FUA write made durable, or a newer one written since,
/// never an older one: through a cache over a raid10 of volatile mems, a raid10 of
/// caches, and a mirror of caches.
#[test]
fn power_cuts_at_random_moments_keep_every_flushed_write() {
    const PAGES: u64 = 64;
    let dir = tmpdir();
    let mut text = String::from(
            "[writeback]\nbackground = \"10%\"\nlimit = \"50%\"\nexpire = \"5ms\"\ninterval = \"2ms\"\n",
        );
    let mem = |n: &str| {
        format!("[device.{n}]\ntype = \"mem\"\nsize = \"4M\"\nblock = 4096\nvolatile = true\n")
    };
    let cache = |n: &str, base: &str| {
        format!("[device.{n}]\ntype = \"cache\"\nbase = \"{base}\"\nmemory = \"1M\"\n")
    };
    // a: cache over raid10 of volatile mems.
    for i in 0..4 {
        text += &mem(&format!("am{i}"));
    }
    text += "[device.ar]\ntype = \"raid10\"\nmembers = [\"am0\", \"am1\", \"am2\", \"am3\"]\nchunk = \"16K\"\n";
    text += &cache("a", "ar");
    // b: raid10 of caches over volatile mems.
    for i in 0..4 {
        text += &mem(&format!("bm{i}"));
        text += &cache(&format!("bc{i}"), &format!("bm{i}"));
    }
    text += "[device.b]\ntype = \"raid10\"\nmembers = [\"bc0\", \"bc1\", \"bc2\", \"bc3\"]\nchunk = \"16K\"\n";
    // c: mirror of caches over volatile mems.
    for i in 0..2 {
        text += &mem(&format!("cm{i}"));
        text += &cache(&format!("cc{i}"), &format!("cm{i}"));
    }
    text += "[device.c]\ntype = \"mirror\"\nmembers = [\"cc0\", \"cc1\"]\n";
    for e in ["a", "b", "c"] {
        text += &format!("[export.{e}]\ndevice = \"{e}\"\n");
    }
    let stack = write_stack(&dir, &text);
    let ctl = dir.path().join("admin.sock");
    let mut srv = Server::start_in(dir, &[path_str(&stack), "--admin", path_str(&ctl)]);

    let mut rng = 0x5eed_u64;
    let mut next = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let mut cuts = 0;
    for export in ["a", "b", "c"] {
        let (mut c, _, _) = Raw::go(&srv.sock, export);
        // Per page: the durable version, and versions written since (possibly newer
        // on the device after a cut).
        let mut durable = vec![0u64; PAGES as usize];
        let mut since: Vec<Vec<u64>> = vec![Vec::new(); PAGES as usize];
        let mut version = 0u64;
        let mut cookie = 1u64;
        for round in 0..60 {
            // A batch of writes to distinct pages, all in flight together.
            let mut pages: Vec<u64> = Vec::new();
            while pages.len() < 8 {
                let p = next(PAGES);
                if !pages.contains(&p) {
                    pages.push(p);
                }
            }
            let mut fua = Vec::new();
            for &p in &pages {
                version += 1;
                let flags = if next(10) == 0 { FLAG_FUA } else { 0 };
                c.request(flags, CMD_WRITE, cookie, p * 4096, 4096, &block(p, version))
                    .unwrap();
                since[p as usize].push(version);
                fua.push((cookie, p, version, flags != 0));
                cookie += 1;
            }
            let cut = next(6) == 0;
            if cut {
                // The cut lands while the batch is in flight (or just done).
                let out = admin(&ctl, &["power-cut"]);
                success("admin power-cut", &out);
                cuts += 1;
            }
            for _ in 0..pages.len() {
                let (err, ck) = c.reply().unwrap();
                assert_eq!(err, 0, "{export} round {round}: write {ck} failed");
                let &(_, p, v, f) = fua.iter().find(|w| w.0 == ck).expect("a known cookie");
                if f && !cut {
                    // Acknowledged FUA with no cut since it was sent: durable.
                    durable[p as usize] = v;
                    since[p as usize].retain(|&x| x > v);
                }
            }
            if cut {
                for p in 0..PAGES {
                    c.request(0, CMD_READ, cookie, p * 4096, 4096, &[]).unwrap();
                    c.expect(cookie, 0);
                    cookie += 1;
                    let data = c.read_exact(4096).unwrap();
                    let what = format!("{export}, round {round}, after cut {cuts}");
                    let v = version_of(p, &data, &what);
                    let allowed = v == durable[p as usize] || since[p as usize].contains(&v);
                    assert!(
                        allowed,
                        "{what}: page {p} reads version {v}; durable {}, written since {:?}",
                        durable[p as usize], since[p as usize]
                    );
                    assert!(
                        v >= durable[p as usize],
                        "{what}: page {p} went back in time"
                    );
                }
                // A fresh start: every page rewritten and flushed.
                for p in 0..PAGES {
                    version += 1;
                    c.write_ok(cookie, 0, p * 4096, &block(p, version));
                    cookie += 1;
                    durable[p as usize] = version;
                    since[p as usize].clear();
                }
                c.request(0, CMD_FLUSH, cookie, 0, 0, &[]).unwrap();
                c.expect(cookie, 0);
                cookie += 1;
            } else if next(3) == 0 {
                // Every write above is acknowledged: a flush makes them all durable.
                c.request(0, CMD_FLUSH, cookie, 0, 0, &[]).unwrap();
                c.expect(cookie, 0);
                cookie += 1;
                for p in 0..PAGES as usize {
                    if let Some(&last) = since[p].last() {
                        durable[p] = last;
                    }
                    since[p].clear();
                }
            }
        }
        c.disconnect();
    }
    assert!(cuts >= 10, "only {cuts} power cuts");
    let (status, log) = srv.stop();
    assert!(status.success(), "exit status {status}; stderr:\n{log}");
}

/// Removing the admin socket's file while serving does not keep SIGTERM from ending
/// the server (its thread used to be woken by connecting to the file).
#[test]
fn sigterm_ends_the_server_even_when_the_admin_socket_file_is_gone() {
    let dir = tmpdir();
    let ctl = dir.path().join("admin.sock");
    let mut srv = Server::start_in(dir, &["--device", "mem:1M", "--admin", path_str(&ctl)]);
    std::fs::remove_file(&ctl).unwrap();
    let (status, log) = srv.stop();
    assert!(status.success(), "exit status {status}; stderr:\n{log}");
}

/// An admin socket path that cannot be bound is refused before anything listens.
#[test]
fn an_admin_socket_in_use_is_refused() {
    let dir = tmpdir();
    let ctl = dir.path().join("admin.sock");
    std::fs::write(&ctl, b"").unwrap();
    let out = run(Command::new(env!("CARGO_BIN_EXE_cairn"))
        .args(["serve", "--listen"])
        .arg(format!("unix:{}", dir.path().join("nbd.sock").display()))
        .arg("--admin")
        .arg(&ctl));
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("--admin"),
        "{}",
        text(&out.stderr)
    );
    assert!(ctl.exists(), "a file that was there is left alone");
    let out = admin(&dir.path().join("none.sock"), &["help"]);
    assert_eq!(out.status.code(), Some(2));
}

/// The engine a file gets is said once in the log and in `status`, with the reason: on
/// tmpfs (the test directory), requests up to 64 KiB are system calls on the reactor; an
/// engine named in the stack file is used as it is and said to be given. Data written
/// through either export reads back.
#[test]
fn status_and_the_log_say_which_engine_a_file_got_and_why() {
    let dir = tmpdir();
    let on_tmpfs = rustix::fs::statfs(dir.path()).is_ok_and(|s| s.f_type as u64 == 0x0102_1994);
    let ctl = dir.path().join("admin.sock");
    let stack = write_stack(
        &dir,
        "[device.picked]\ntype = \"file\"\npath = \"picked.img\"\nsize = \"4M\"\n\
         [device.named]\ntype = \"file\"\npath = \"named.img\"\nsize = \"4M\"\nengine = \"aio\"\n\
         [export.picked]\ndevice = \"picked\"\n[export.named]\ndevice = \"named\"\n",
    );
    let mut srv = Server::start_in(dir, &[path_str(&stack), "--admin", path_str(&ctl)]);
    for (i, export) in ["picked", "named"].into_iter().enumerate() {
        let (mut c, _, _) = Raw::go(&srv.sock, export);
        let small = random_bytes(4096, 40 + i as u64);
        let large = random_bytes(1 << 20, 50 + i as u64);
        c.write_ok(1, 0, 8192, &small);
        c.write_ok(2, 0, 1 << 20, &large);
        assert!(
            c.read_ok(3, 8192, 4096) == small,
            "{export}: 4 KiB read back"
        );
        assert!(
            c.read_ok(4, 1 << 20, 1 << 20) == large,
            "{export}: 1 MiB read back"
        );
    }
    let out = success("status", &admin(&ctl, &["status"]));
    let line = |name: &str| {
        out.lines()
            .find(|l| l.trim_start().starts_with(&format!("{name} (4MiB) file")))
            .unwrap_or_else(|| panic!("no line for {name}: {out}"))
            .to_string()
    };
    let (picked, named) = (line("picked"), line("named"));
    assert!(named.contains("engine=aio direct=0"), "{named}");
    assert!(named.contains("engine: engine=aio given ("), "{named}");
    assert!(picked.contains("engine=io_uring"), "{picked}");
    assert!(picked.contains("non-blocking reads"), "{picked}");
    if on_tmpfs {
        let chosen = "engine=io_uring (reads and writes inline up to 64KiB) direct=0";
        assert!(picked.contains(chosen), "{picked}");
        assert!(
            picked.contains("tmpfs buffered, non-blocking reads unsupported"),
            "{picked}"
        );
    }
    let (_, log) = srv.stop();
    for name in [
        "picked.img: engine io_uring",
        "named.img: engine aio: engine=aio given",
    ] {
        assert_eq!(log.matches(name).count(), 1, "{name} once in:\n{log}");
    }
}

/// Every refusal reaches `cairn admin` as one line: a command line over 1 KiB gets the
/// server's reason (the server reads it to its end before it answers, where closing with
/// unread bytes reset the connection), and words a command does not take, or a bad name,
/// are refused rather than ignored.
#[test]
fn refusals_reach_the_client_as_one_line() {
    let dir = tmpdir();
    let ctl = dir.path().join("admin.sock");
    let srv = Server::start_in(tmpdir(), &["--device", "mem:1M", "--admin", path_str(&ctl)]);
    let long = "x".repeat(4000);
    let out = admin(&ctl, &["devices", &long]);
    let said = text(&out.stderr);
    assert!(
        !out.status.success() && said.contains("command longer than 1024 bytes"),
        "{said}"
    );
    assert_eq!(said.lines().count(), 1, "{said}");
    for (words, why) in [
        (
            vec!["devices", "extra", "words"],
            "devices (it takes no words)",
        ),
        (vec!["help", "me"], "help (it takes no words)"),
        (vec!["status", "--json", "x"], "usage: status [--json]"),
        (vec!["stats", "x"], "usage: stats [--json]"),
        (vec!["export", "add", "e/x", "pool", "v"], "has a '/'"),
    ] {
        let out = admin(&ctl, &words);
        let said = text(&out.stderr);
        assert!(
            !out.status.success() && said.contains(why),
            "{words:?}: {said}"
        );
        assert_eq!(said.lines().count(), 1, "{words:?}: {said}");
    }
    // The server answers on.
    success("devices", &admin(&ctl, &["devices"]));
    drop(srv);
}
