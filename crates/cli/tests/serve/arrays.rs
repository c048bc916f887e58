use super::admin::{admin, block, version_of};
use super::*;

/// `status` on the admin socket shows each array with metadata like /proc/mdstat:
/// members and states, degraded or not, and a rebuild's progress.
#[test]
fn status_shows_members_states_and_rebuild_progress() {
    let dir = tmpdir();
    let ctl = dir.path().join("admin.sock");
    let file = |n: &str| {
        format!(
            "[device.{n}]\ntype = \"file\"\npath = \"{}\"\nsize = \"33M\"\n",
            dir.path().join(format!("{n}.img")).display()
        )
    };
    let text = format!(
        "{}{}[device.slow]\ntype = \"delay\"\nbase = \"b\"\nbandwidth = \"2M\"\n\
             [device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"slow\"]\nmetadata = \"1\"\n\
             [device.d]\ntype = \"mirror\"\nmembers = [\"c\", \"missing\"]\nmetadata = \"1\"\n\
             [export.m]\ndevice = \"m\"\n[export.d]\ndevice = \"d\"\n",
        file("a"),
        file("b"),
    ) + &file("c");
    let stack = write_stack(&dir, &text);
    // Made once with both members, then b is replaced by a blank file: rebuilt at the
    // next start, at 2 MB/s (16 s), long enough to be seen.
    {
        let mut srv = Server::start_in(tmpdir(), &[path_str(&stack)]);
        let (status, log) = srv.stop();
        assert!(status.success(), "{log}");
    }
    std::fs::remove_file(dir.path().join("b.img")).unwrap();
    let mut srv = Server::start_in(dir, &[path_str(&stack), "--admin", path_str(&ctl)]);
    let out = success("admin status", &admin(&ctl, &["status"]));
    assert!(out.contains("m: mirror of 2 members"), "{out}");
    assert!(out.contains("[U_] a active, slow rebuilding"), "{out}");
    assert!(out.contains("rebuild ") && out.contains("% ("), "{out}");
    assert!(
        out.contains("d: mirror of 2 members") && out.contains("degraded"),
        "{out}"
    );
    assert!(out.contains("[U_] c active, missing missing"), "{out}");
    let (status, log) = srv.stop();
    assert!(status.success(), "{log}");
    // Stopped part way, the rebuild kept its checkpoint for the next start.
    assert!(log.contains("rebuild stopped at"), "{log}");
}

/// `fail` and `remove` on a running mirror: the array goes on degraded with every
/// write reading back, never gives up its last current copy; the stack file then
/// names the member `missing`, and added back it is rebuilt whole (it was taken out).
#[test]
fn admin_fail_and_remove_a_member_then_it_is_added_back_whole() {
    const PAGES: u64 = 64;
    let dir = tmpdir();
    let ctl = dir.path().join("admin.sock");
    let (a, b) = (dir.path().join("a.img"), dir.path().join("b.img"));
    let stack = write_stack(
        &dir,
        &format!(
            "[device.a]\ntype = \"file\"\npath = \"{}\"\nsize = \"9M\"\n\
                 [device.b]\ntype = \"file\"\npath = \"{}\"\nsize = \"9M\"\n\
                 [device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"b\"]\nmetadata = \"1\"\n\
                 bitmap = \"64K\"\nbitmap_delay = \"100ms\"\n",
            a.display(),
            b.display()
        ),
    );
    let stride = 128u64 << 10;
    let write_all = |srv: &Server, version: u64| {
        let (mut c, _, _) = Raw::go(&srv.sock, "");
        for p in 0..PAGES {
            c.request(0, CMD_WRITE, p + 1, p * stride, 4096, &block(p, version))
                .unwrap();
            c.expect(p + 1, 0);
        }
        c.request(0, CMD_FLUSH, 999, 0, 0, &[]).unwrap();
        c.expect(999, 0);
        for p in 0..PAGES {
            c.request(0, CMD_READ, p + 1000, p * stride, 4096, &[])
                .unwrap();
            c.expect(p + 1000, 0);
            let data = c.read_exact(4096).unwrap();
            assert_eq!(version_of(p, &data, "read back"), version);
        }
        c.disconnect();
    };
    let srv_args = [path_str(&stack), "--admin", path_str(&ctl)];
    let mut srv = Server::start_in(tmpdir(), &srv_args);
    write_all(&srv, 1);
    // Bits clear once the regions stay idle.
    let clean = || {
        let out = success("status", &admin(&ctl, &["status"]));
        out.contains("bitmap: 0 of")
    };
    let t = std::time::Instant::now();
    while !clean() {
        assert!(t.elapsed() < Duration::from_secs(60), "bits never cleared");
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = success("fail a", &admin(&ctl, &["fail", "m", "a"]));
    assert!(out.contains("member 'a' failed"), "{out}");
    let out = success("status", &admin(&ctl, &["status"]));
    assert!(out.contains("[_U] a failed, b active"), "{out}");
    // The last current copy is kept, and bad requests change nothing.
    for (words, why) in [
        (&["fail", "m", "b"][..], "no current copy"),
        (&["fail", "m", "a"][..], "failed already"),
        (&["remove", "m", "b"][..], "in use"),
        (&["fail", "m", "zz"][..], "no member 'zz'"),
        (&["fail", "a", "x"][..], "not an array"),
        (&["fail", "nope", "a"][..], "no device 'nope'"),
        (&["fail", "m"][..], "usage"),
    ] {
        let out = admin(&ctl, words);
        assert!(!out.status.success(), "{words:?} succeeded");
        let text = text(&out.stdout) + &text(&out.stderr);
        assert!(text.contains(why), "{words:?}: {text}");
    }
    // Degraded writes, to 4 of the 64 pages' regions.
    {
        let (mut c, _, _) = Raw::go(&srv.sock, "");
        for p in [3u64, 20, 21, 40] {
            c.request(0, CMD_WRITE, p + 1, p * stride, 4096, &block(p, 2))
                .unwrap();
            c.expect(p + 1, 0);
        }
        c.disconnect();
    }
    let out = success("remove a", &admin(&ctl, &["remove", "m", "a"]));
    assert!(out.contains("removed"), "{out}");
    let out = success("status", &admin(&ctl, &["status"]));
    assert!(out.contains("a missing, b active"), "{out}");
    assert!(out.contains("bitmap: 4 of"), "{out}");
    let (status, log) = srv.stop();
    assert!(status.success(), "{log}");
    assert!(log.contains("failed by the admin"), "{log}");
    // The stack file says so, and a carries a superblock that says it was taken out:
    // the next start runs on b alone, and never reads a as current.
    let kept = std::fs::read_to_string(&stack).unwrap();
    assert!(kept.contains("members = [\"missing\", \"b\"]"), "{kept}");
    let mut srv = Server::start_in(tmpdir(), &srv_args);
    // Added back, a is rebuilt whole from b (its old contents are out of date).
    let out = success(
        "add a back",
        &admin(&ctl, &["add", "m", &format!("file:{}", a.display())]),
    );
    assert!(out.contains("added in place of"), "{out}");
    assert!(
        srv.wait_for_stderr(" done: ", Duration::from_secs(60)),
        "{}",
        srv.stderr()
    );
    let whole = 8u64 << 20;
    assert!(
        srv.stderr()
            .contains(&format!("read {whole} bytes, wrote {whole} bytes")),
        "{}",
        srv.stderr()
    );
    let (status, log) = srv.stop();
    assert!(status.success(), "{log}");
    let (da, db) = (std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    let data = (1 << 20)..(9 << 20);
    assert!(da[data.clone()] == db[data], "the members differ");
    for p in 0..PAGES {
        let at = (1 << 20) + (p * stride) as usize;
        let v = if [3, 20, 21, 40].contains(&p) { 2 } else { 1 };
        assert_eq!(version_of(p, &da[at..at + 4096], "member a"), v);
    }
}

/// `re-add` on a running mirror: a member failed while writes went on comes back
/// copying only the regions written while it was out (all of it without a bitmap),
/// and then holds every write: with the other member failed, every page reads back.
#[test]
fn admin_re_add_takes_a_failed_member_back_copying_only_what_it_missed() {
    const PAGES: u64 = 64;
    let stride = 128u64 << 10;
    for bitmap in ["64K", "none"] {
        let dir = tmpdir();
        let ctl = dir.path().join("admin.sock");
        let (a, b) = (dir.path().join("a.img"), dir.path().join("b.img"));
        let stack = write_stack(
            &dir,
            &format!(
                "[device.a]\ntype = \"file\"\npath = \"{}\"\nsize = \"9M\"\n\
                     [device.b]\ntype = \"file\"\npath = \"{}\"\nsize = \"9M\"\n\
                     [device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"b\"]\nmetadata = \"1\"\n\
                     bitmap = \"{bitmap}\"\n{delay}",
                a.display(),
                b.display(),
                delay = if bitmap == "none" {
                    ""
                } else {
                    "bitmap_delay = \"100ms\"\n"
                }
            ),
        );
        let mut srv = Server::start_in(tmpdir(), &[path_str(&stack), "--admin", path_str(&ctl)]);
        let write = |pages: &[u64], version: u64| {
            let (mut c, _, _) = Raw::go(&srv.sock, "");
            for &p in pages {
                c.request(0, CMD_WRITE, p + 1, p * stride, 4096, &block(p, version))
                    .unwrap();
                c.expect(p + 1, 0);
            }
            c.request(0, CMD_FLUSH, 999, 0, 0, &[]).unwrap();
            c.expect(999, 0);
            c.disconnect();
        };
        let read_all = |changed: &[u64], what: &str| {
            let (mut c, _, _) = Raw::go(&srv.sock, "");
            for p in 0..PAGES {
                c.request(0, CMD_READ, p + 1000, p * stride, 4096, &[])
                    .unwrap();
                c.expect(p + 1000, 0);
                let data = c.read_exact(4096).unwrap();
                let v = if changed.contains(&p) { 2 } else { 1 };
                assert_eq!(version_of(p, &data, what), v, "{what}");
            }
            c.disconnect();
        };
        let all: Vec<u64> = (0..PAGES).collect();
        write(&all, 1);
        let status = || success("status", &admin(&ctl, &["status"]));
        let t = std::time::Instant::now();
        while bitmap != "none" && !status().contains("bitmap: 0 of") {
            assert!(t.elapsed() < Duration::from_secs(60), "bits never cleared");
            std::thread::sleep(Duration::from_millis(50));
        }
        // Bad requests change nothing.
        for (words, why) in [
            (&["re-add", "m", "a"][..], "has not failed"),
            (&["re-add", "m", "zz"][..], "no member 'zz'"),
            (&["re-add", "m"][..], "usage"),
        ] {
            let out = admin(&ctl, words);
            assert!(!out.status.success(), "{words:?} succeeded");
            let text = text(&out.stdout) + &text(&out.stderr);
            assert!(text.contains(why), "{words:?}: {text}");
        }
        success("fail a", &admin(&ctl, &["fail", "m", "a"]));
        let changed = [3u64, 20, 21, 40];
        write(&changed, 2);
        let out = success("re-add a", &admin(&ctl, &["re-add", "m", "a"]));
        if bitmap == "none" {
            assert!(out.contains("rebuilding it whole"), "{out}");
        } else {
            assert!(
                out.contains("copying the 4 of 128 regions of 64KiB"),
                "{out}"
            );
        }
        let t = std::time::Instant::now();
        while !status().contains("[UU]") {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "never rebuilt: {}",
                status()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let moved = if bitmap == "none" {
            8u64 << 20
        } else {
            4 * (64 << 10)
        };
        assert!(
            status().contains(&format!("read {moved} bytes, wrote {moved} bytes")),
            "{}",
            status()
        );
        read_all(&changed, "both members");
        // a alone holds every write: the one it missed came with the re-add.
        success("fail b", &admin(&ctl, &["fail", "m", "b"]));
        read_all(&changed, "a alone");
        let (code, log) = srv.stop();
        assert!(code.success(), "{log}");
        assert!(log.contains("member a re-added by the admin"), "{log}");
        let (da, db) = (std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
        let data = (1 << 20)..(9 << 20);
        assert!(
            da[data.clone()] == db[data],
            "the members differ ({bitmap})"
        );
    }
}

/// A member left out of a start (named `missing`) and added back while the array
/// runs is known by its superblock: only the regions written without it are copied.
/// A device of the same array that ran on without it (events ahead) is refused.
#[test]
fn a_member_left_out_of_a_start_and_added_back_copies_only_what_it_missed() {
    const PAGES: u64 = 64;
    let stride = 128u64 << 10;
    let dir = tmpdir();
    let ctl = dir.path().join("admin.sock");
    let (a, b) = (dir.path().join("a.img"), dir.path().join("b.img"));
    let text = |members: &str| {
        format!(
            "[device.a]\ntype = \"file\"\npath = \"{}\"\nsize = \"9M\"\n\
                 [device.b]\ntype = \"file\"\npath = \"{}\"\nsize = \"9M\"\n\
                 [device.m]\ntype = \"mirror\"\nmembers = [{members}]\nmetadata = \"1\"\n\
                 bitmap = \"64K\"\nbitmap_delay = \"100ms\"\n",
            a.display(),
            b.display()
        )
    };
    let both = write_stack(&dir, &text("\"a\", \"b\""));
    let args = [path_str(&both), "--admin", path_str(&ctl)];
    let write = |srv: &Server, pages: &[u64], version: u64| {
        let (mut c, _, _) = Raw::go(&srv.sock, "");
        for &p in pages {
            c.request(0, CMD_WRITE, p + 1, p * stride, 4096, &block(p, version))
                .unwrap();
            c.expect(p + 1, 0);
        }
        c.request(0, CMD_FLUSH, 999, 0, 0, &[]).unwrap();
        c.expect(999, 0);
        c.disconnect();
    };
    let all: Vec<u64> = (0..PAGES).collect();
    let mut srv = Server::start_in(tmpdir(), &args);
    write(&srv, &all, 1);
    let status = || success("status", &admin(&ctl, &["status"]));
    let t = std::time::Instant::now();
    while !status().contains("bitmap: 0 of") {
        assert!(t.elapsed() < Duration::from_secs(60), "bits never cleared");
        std::thread::sleep(Duration::from_millis(50));
    }
    let (code, log) = srv.stop();
    assert!(code.success(), "{log}");
    // Started without b, on purpose.
    let one = dir.path().join("one.toml");
    let without_b = text("\"a\", \"missing\"");
    let b_table = format!(
        "[device.b]\ntype = \"file\"\npath = \"{}\"\nsize = \"9M\"\n",
        b.display()
    );
    std::fs::write(&one, without_b.replace(&b_table, "")).unwrap();
    let mut srv = Server::start_in(tmpdir(), &[path_str(&one), "--admin", path_str(&ctl)]);
    let changed = [3u64, 20, 21, 40];
    write(&srv, &changed, 2);
    let spec = format!("file:{}", b.display());
    let out = success("add b", &admin(&ctl, &["add", "m", &spec]));
    assert!(out.contains("added in place of 'missing'"), "{out}");
    let t = std::time::Instant::now();
    while !status().contains("[UU]") {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "never rebuilt: {}",
            status()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let moved = 4 * (64u64 << 10);
    assert!(
        status().contains(&format!("read {moved} bytes, wrote {moved} bytes")),
        "{}",
        status()
    );
    // b alone reads back every write.
    success("fail a", &admin(&ctl, &["fail", "m", "a"]));
    {
        let (mut c, _, _) = Raw::go(&srv.sock, "");
        for p in 0..PAGES {
            c.request(0, CMD_READ, p + 1000, p * stride, 4096, &[])
                .unwrap();
            c.expect(p + 1000, 0);
            let data = c.read_exact(4096).unwrap();
            let v = if changed.contains(&p) { 2 } else { 1 };
            assert_eq!(version_of(p, &data, "b alone"), v);
        }
        c.disconnect();
    }
    let (code, log) = srv.stop();
    assert!(code.success(), "{log}");
    assert!(log.contains("copying the 4 of 128 regions"), "{log}");
}

#[test]
fn kill_9_under_writes_then_resync_keeps_every_flushed_write_and_the_copies_agree() {
    // Pages spread over the whole array, so that the write-intent bitmap (64 KiB
    // regions, bits cleared after 100 ms idle) sees regions set and cleared while
    // the server runs, and the kill lands with writes in flight to some of them.
    const PAGES: u64 = 256;
    const STRIDE: u64 = 32 << 10;
    let images = tmpdir();
    let (a, b) = (images.path().join("a.img"), images.path().join("b.img"));
    let stack = write_stack(
        &images,
        &format!(
            "[device.a]\ntype = \"file\"\npath = \"{}\"\nsize = \"9M\"\n\
                 [device.b]\ntype = \"file\"\npath = \"{}\"\nsize = \"9M\"\n\
                 [device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"b\"]\nmetadata = \"1\"\n\
                 bitmap = \"64K\"\nbitmap_delay = \"100ms\"\n",
            a.display(),
            b.display()
        ),
    );
    let mut rng = 0x6b11_u64;
    let mut next = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    // Per page: the version a flush made durable, and versions written since.
    let mut durable = vec![0u64; PAGES as usize];
    let mut since: Vec<Vec<u64>> = vec![Vec::new(); PAGES as usize];
    let mut version = 0u64;
    for kill in 0..6 {
        let mut srv = Server::start(&[path_str(&stack)]);
        if kill > 0 {
            assert!(
                srv.wait_for_stderr("resync of", Duration::from_secs(60))
                    && srv.wait_for_stderr(" done: ", Duration::from_secs(60)),
                "no resync after kill {kill}:\n{}",
                srv.stderr()
            );
        }
        let (mut c, _, _) = Raw::go(&srv.sock, "");
        let mut cookie = 1u64;
        for p in 0..PAGES {
            c.request(0, CMD_READ, cookie, p * STRIDE, 4096, &[])
                .unwrap();
            c.expect(cookie, 0);
            cookie += 1;
            let data = c.read_exact(4096).unwrap();
            let what = format!("after kill {kill}");
            let v = version_of(p, &data, &what);
            let allowed = v == durable[p as usize] || since[p as usize].contains(&v);
            assert!(
                allowed,
                "{what}: page {p} reads version {v}; durable {}, written since {:?}",
                durable[p as usize], since[p as usize]
            );
            // What reads back now is what the array holds from here on.
            durable[p as usize] = v;
            since[p as usize].clear();
        }
        if kill == 5 {
            c.disconnect();
            let (status, log) = srv.stop();
            assert!(status.success(), "exit status {status}; stderr:\n{log}");
            break;
        }
        // Batches of pipelined writes, a flush now and then, and the kill with a
        // batch in flight.
        let batches = 5 + next(20);
        for batch in 0..=batches {
            let mut pages = Vec::new();
            while pages.len() < 16 {
                let p = next(PAGES);
                if !pages.contains(&p) {
                    pages.push(p);
                }
            }
            for &p in &pages {
                version += 1;
                c.request(0, CMD_WRITE, cookie, p * STRIDE, 4096, &block(p, version))
                    .unwrap();
                since[p as usize].push(version);
                cookie += 1;
            }
            if batch == batches {
                srv.signal(libc::SIGKILL);
                break;
            }
            for _ in 0..pages.len() {
                let (err, _) = c.reply().unwrap();
                assert_eq!(err, 0, "a write failed");
            }
            if next(4) == 0 {
                // Idle long enough for bits to be cleared.
                std::thread::sleep(Duration::from_millis(250));
            }
            if next(3) == 0 {
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
        let (status, _) = srv.wait_exit();
        assert!(!status.success(), "killed");
    }
    // Resynced and stopped cleanly: the two members hold the same data.
    let (da, db) = (std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    let data = (1 << 20)..(9 << 20);
    assert!(
        da[data.clone()] == db[data],
        "the members differ after the resync"
    );
}

/// Pages (4 KiB, 64 KiB apart) of a 16 MiB mirror through crashes during a rebuild.
const PAGES: u64 = 256;
const STRIDE: u64 = 64 << 10;
const DATA_BYTES: usize = 16 << 20;

/// A pseudo-random `next(n)` in `0..n` (xorshift), from `seed`.
fn xorshift(seed: u64) -> impl FnMut(u64) -> u64 {
    let mut rng = seed;
    move |n| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    }
}

/// What each page may read: the version a flush (or an acknowledged FUA write) made
/// durable, or one written since.
struct Pages {
    durable: Vec<u64>,
    since: Vec<Vec<u64>>,
    version: u64,
}

impl Pages {
    fn new() -> Pages {
        Pages {
            durable: vec![0; PAGES as usize],
            since: vec![Vec::new(); PAGES as usize],
            version: 0,
        }
    }

    /// Writes every page once through a server of `stack`, flushes, stops it.
    fn fill(&mut self, stack: &Path) {
        let mut srv = Server::start(&[path_str(stack)]);
        let (mut c, _, _) = Raw::go(&srv.sock, "");
        self.version += 1;
        for p in 0..PAGES {
            c.request(
                0,
                CMD_WRITE,
                p + 1,
                p * STRIDE,
                4096,
                &block(p, self.version),
            )
            .unwrap();
            c.expect(p + 1, 0);
            self.durable[p as usize] = self.version;
        }
        c.request(0, CMD_FLUSH, 9999, 0, 0, &[]).unwrap();
        c.expect(9999, 0);
        c.disconnect();
        let (status, log) = srv.stop();
        assert!(status.success(), "exit status {status}; stderr:\n{log}");
    }

    /// Reads every page, checks it, and takes what it read as durable (what reads
    /// back now is what the array holds from here on).
    /// The last start of a crash test: the rebuild runs to its end, and then reads
    /// (which may now use either copy) still find every page as it was; the server
    /// stops cleanly.
    fn finish_rebuild(
        &mut self,
        mut srv: Server,
        mut c: Raw,
        cookie: &mut u64,
        what: &str,
        logs: &mut String,
    ) {
        assert!(
            srv.wait_for_stderr(" done: ", Duration::from_secs(120)),
            "{what}: the rebuild never ended:\n{}",
            srv.stderr()
        );
        let so_far = format!("{logs}--- {what} (running)\n{}", srv.stderr());
        self.check(
            &mut c,
            cookie,
            &format!("{what}, after the rebuild"),
            &so_far,
        );
        c.disconnect();
        let (status, log) = srv.stop();
        assert!(status.success(), "exit status {status}; stderr:\n{log}");
        *logs += &format!("--- {what} (stopped after the rebuild)\n{log}");
    }

    fn check(&mut self, c: &mut Raw, cookie: &mut u64, what: &str, logs: &str) {
        for p in 0..PAGES {
            c.request(0, CMD_READ, *cookie, p * STRIDE, 4096, &[])
                .unwrap();
            c.expect(*cookie, 0);
            *cookie += 1;
            let data = c.read_exact(4096).unwrap();
            let v = version_of(p, &data, what);
            let (d, s) = (&mut self.durable[p as usize], &mut self.since[p as usize]);
            assert!(
                v == *d || s.contains(&v),
                "{what}: page {p} reads version {v}; durable {d}, written since {s:?}\n{logs}"
            );
            *d = v;
            s.clear();
        }
    }

    /// 16 distinct pages picked at random.
    fn batch(&self, next: &mut impl FnMut(u64) -> u64) -> Vec<u64> {
        let mut pages = Vec::new();
        while pages.len() < 16 {
            let p = next(PAGES);
            if !pages.contains(&p) {
                pages.push(p);
            }
        }
        pages
    }

    /// A new version of page `p` is being written: which.
    fn written(&mut self, p: u64) -> u64 {
        self.version += 1;
        self.since[p as usize].push(self.version);
        self.version
    }

    /// Version `v` of page `p` is durable (an acknowledged FUA write).
    fn durable_now(&mut self, p: u64, v: u64) {
        self.durable[p as usize] = v;
        self.since[p as usize].retain(|&x| x > v);
    }

    /// A flush completed: the last version written of every page is durable.
    fn flushed(&mut self) {
        for p in 0..PAGES as usize {
            if let Some(&v) = self.since[p].last() {
                self.durable[p] = v;
            }
            self.since[p].clear();
        }
    }

    /// Rebuilt and stopped cleanly: both member files hold every page as last read,
    /// and the same data.
    fn members_hold(&self, a: &Path, b: &Path, logs: &str) {
        let (da, db) = (std::fs::read(a).unwrap(), std::fs::read(b).unwrap());
        let mut wrong = Vec::new();
        for p in 0..PAGES {
            let at = (1 << 20) + (p * STRIDE) as usize;
            let va = version_of(p, &da[at..at + 4096], "member a");
            let vb = version_of(p, &db[at..at + 4096], "member b");
            let d = self.durable[p as usize];
            if va != d || vb != d {
                wrong.push(format!(
                    "page {p} (offset {}): a holds {va}, b {vb}, the array read {d}",
                    p * STRIDE
                ));
            }
        }
        assert!(
            wrong.is_empty(),
            "after the rebuild, {} pages are not as the array read them:\n{}\n{logs}",
            wrong.len(),
            wrong.join("\n")
        );
        let data = (1 << 20)..(1 << 20) + DATA_BYTES;
        assert!(
            da[data.clone()] == db[data],
            "the members differ after the rebuild:\n{logs}"
        );
    }
}

/// Kills the server (SIGKILL) while a mirror rebuilds a blank member, writes in
/// flight, several times; once, stops it cleanly instead. After each start every page
/// reads the version a flush made durable or one written since; a rebuild stopped
/// cleanly resumes from its checkpoint; and once the last rebuild is done the members
/// hold the same data. The new member sits under a `delay` device (5 ms a write, 8 MB/s)
/// so that a kill lands with writes done on one member and not yet on the other. A
/// round writes for 0.2 to 2.5 s, and the rebuild of 16 MiB at 2 to 4 MB/s takes
/// longer, so the kills land while it runs (were one to land after it, the checks still
/// hold; they only test less).
#[test]
fn kill_9_during_a_rebuild_then_it_resumes_and_every_flushed_write_survives() {
    const ROUNDS: usize = 4;
    /// The round that ends with SIGTERM (the others with SIGKILL): the first, while
    /// the rebuild runs (a resync, after a kill, starts over at the next start).
    const CLEAN_STOP: usize = 0;
    let images = tmpdir();
    let (a, b) = (images.path().join("a.img"), images.path().join("b.img"));
    let stack = write_stack(
        &images,
        &format!(
            "[device.a]\ntype = \"file\"\npath = \"{}\"\nsize = \"17M\"\n\
                 [device.b]\ntype = \"file\"\npath = \"{}\"\nsize = \"17M\"\n\
                 [device.slow]\ntype = \"delay\"\nbase = \"b\"\n\
                 write = \"5ms\"\nbandwidth = \"8M\"\n\
                 [device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"slow\"]\nmetadata = \"1\"\n\
                 bitmap = \"64K\"\nbitmap_delay = \"100ms\"\n\
                 rebuild_min = \"2M\"\nrebuild_max = \"4M\"\n",
            a.display(),
            b.display()
        ),
    );
    let mut next = xorshift(0x2eb1);
    let mut pages = Pages::new();

    // Made with both members and written once, then b is replaced by a blank file
    // (the stack's `size` makes it again): the next start rebuilds it.
    pages.fill(&stack);
    std::fs::remove_file(&b).unwrap();

    // Where the next start must resume the rebuild (after a clean stop part way).
    let mut resume_at: Option<u64> = None;
    // Whether the rebuild or resync is known to be over (then a clean stop leaves
    // nothing to do at the next start).
    let mut over = false;
    // Every round's stderr, for the messages of the last checks.
    let mut logs = String::new();
    for round in 0..=ROUNDS {
        let mut srv = Server::start(&[path_str(&stack)]);
        let what = format!("round {round}");
        if !over {
            assert!(
                srv.wait_for_stderr(" started at ", Duration::from_secs(60)),
                "{what}: no rebuild or resync:\n{}",
                srv.stderr()
            );
        }
        if let Some(at) = resume_at.take() {
            let log = srv.stderr();
            assert!(
                log.contains(&format!("rebuild of 'slow' started at {at} of ")),
                "{what}: the rebuild does not resume at its checkpoint {at}:\n{log}"
            );
        }
        let (mut c, _, _) = Raw::go(&srv.sock, "");
        let mut cookie = 1u64;
        let so_far = |srv: &Server| format!("{logs}--- {what} (running)\n{}", srv.stderr());
        pages.check(&mut c, &mut cookie, &what, &so_far(&srv));
        if round == ROUNDS {
            pages.finish_rebuild(srv, c, &mut cookie, &what, &mut logs);
            break;
        }
        // Batches of pipelined writes, a flush now and then, until a moment picked at
        // random; then the kill with a batch in flight (or, once, a clean stop).
        let end = Instant::now() + Duration::from_millis(200 + next(2300));
        loop {
            let batch = pages.batch(&mut next);
            for &p in &batch {
                let v = pages.written(p);
                c.request(0, CMD_WRITE, cookie, p * STRIDE, 4096, &block(p, v))
                    .unwrap();
                cookie += 1;
            }
            let last = Instant::now() >= end;
            if last && round != CLEAN_STOP {
                // Most often with the batch written to a and on its way to b.
                std::thread::sleep(Duration::from_millis(1 + next(4)));
                srv.signal(libc::SIGKILL);
                break;
            }
            for _ in 0..batch.len() {
                let (err, _) = c.reply().unwrap();
                assert_eq!(err, 0, "{what}: a write failed");
            }
            if last || next(2) == 0 {
                c.request(0, CMD_FLUSH, cookie, 0, 0, &[]).unwrap();
                c.expect(cookie, 0);
                cookie += 1;
                pages.flushed();
            }
            if last {
                break;
            }
            // Quiet moments, in which the rebuild may copy what the writes touch.
            std::thread::sleep(Duration::from_millis(next(20)));
        }
        let log = if round == CLEAN_STOP {
            c.disconnect();
            let (status, log) = srv.stop();
            assert!(status.success(), "exit status {status}; stderr:\n{log}");
            // Stopped part way, the rebuild keeps its checkpoint for the next start.
            resume_at = log.split("stopped at ").nth(1).map(|rest| {
                let n = rest.split(' ').next().unwrap();
                n.parse().unwrap_or_else(|_| panic!("a checkpoint: {n}"))
            });
            log
        } else {
            let (status, log) = srv.wait_exit();
            assert!(!status.success(), "killed");
            log
        };
        let how = if round == CLEAN_STOP {
            "SIGTERM"
        } else {
            "SIGKILL"
        };
        logs += &format!("--- {what} ({how})\n{log}");
        // After a kill, a resync always follows; after a clean stop, a rebuild
        // only if this one had not ended.
        over = round == CLEAN_STOP && log.contains(" done: ");
    }
    // Rebuilt and stopped cleanly: both members hold every page as last read, and the
    // same data.
    pages.members_hold(&a, &b, &logs);
}

/// Cuts the power of a mirror whose members are write-back caches (`cache` over
/// files) while it rebuilds a blank member, writes in flight, and kills the server
/// right after (SIGKILL, as the cut would end it), several times. The cut (`power-cut`
/// on the admin socket) loses what the caches held that no flush or FUA write made
/// durable, so after each start every page must read the version a flush or an
/// acknowledged FUA write made durable, or one written since; and once the last
/// rebuild is done and the server stopped cleanly, the members hold the same data,
/// every page as last read. The new member's cache sits over a `delay` device (5 ms a
/// write, 8 MB/s) so that its write-back lags; the cache of the other does not. A
/// round writes for 0.2 to 2.5 s, and the rebuild (or resync, after a cut) of 16 MiB
/// at 2 to 4 MB/s takes longer, so the cuts land while it runs (were one to land after
/// it, the checks still hold; they only test less).
///
/// The bitmap's regions are 1 MiB (16 pages each), not 64 KiB: setting a bit writes
/// the superblocks with FUA and a flush, which write back everything the caches hold,
/// and with a region per page nearly every batch set one, so the cuts found the
/// caches all but clean. With 16 regions every bit is set after the first batches
/// (none is cleared while a rebuild runs), and a cut takes what was written since the
/// last flush and not yet written back (a batch, typically, on both members).
#[test]
fn power_cut_during_a_rebuild_then_every_flushed_write_survives() {
    /// Rounds that end with a power cut; one more runs the rebuild to its end.
    const ROUNDS: usize = 4;
    let images = tmpdir();
    let (a, b) = (images.path().join("a.img"), images.path().join("b.img"));
    let stack = write_stack(
        &images,
        &format!(
            "[device.a]\ntype = \"file\"\npath = \"{}\"\nsize = \"17M\"\n\
                 [device.b]\ntype = \"file\"\npath = \"{}\"\nsize = \"17M\"\n\
                 [device.ca]\ntype = \"cache\"\nbase = \"a\"\nmemory = \"16M\"\n\
                 [device.slow]\ntype = \"delay\"\nbase = \"b\"\n\
                 write = \"5ms\"\nbandwidth = \"8M\"\n\
                 [device.cb]\ntype = \"cache\"\nbase = \"slow\"\nmemory = \"16M\"\n\
                 [device.m]\ntype = \"mirror\"\nmembers = [\"ca\", \"cb\"]\nmetadata = \"1\"\n\
                 bitmap = \"1M\"\nbitmap_delay = \"100ms\"\n\
                 rebuild_min = \"2M\"\nrebuild_max = \"4M\"\n",
            a.display(),
            b.display()
        ),
    );
    // (A flush or an acknowledged FUA write makes a version durable; after a start
    // the caches are empty: what reads back is on a member's file.)
    let mut next = xorshift(0x9c07);
    let mut pages = Pages::new();

    // Made with both members and written once, then b is replaced by a blank file
    // (the stack's `size` makes it again): the next start rebuilds it.
    pages.fill(&stack);
    std::fs::remove_file(&b).unwrap();

    // Every round's stderr, for the messages of the last checks.
    let mut logs = String::new();
    for round in 0..=ROUNDS {
        // The admin socket in the server's own directory: a killed server leaves
        // its file behind.
        let dir = tmpdir();
        let ctl = dir.path().join("admin.sock");
        let mut srv = Server::start_in(dir, &[path_str(&stack), "--admin", path_str(&ctl)]);
        let what = format!("round {round}");
        // A rebuild at the first start, a resync (and the rebuild, from the start)
        // after each cut.
        assert!(
            srv.wait_for_stderr(" started at ", Duration::from_secs(60)),
            "{what}: no rebuild or resync:\n{}",
            srv.stderr()
        );
        let (mut c, _, _) = Raw::go(&srv.sock, "");
        let mut cookie = 1u64;
        let so_far = |srv: &Server| format!("{logs}--- {what} (running)\n{}", srv.stderr());
        pages.check(&mut c, &mut cookie, &what, &so_far(&srv));
        if round == ROUNDS {
            pages.finish_rebuild(srv, c, &mut cookie, &what, &mut logs);
            break;
        }
        // Batches of pipelined writes (a few FUA), a flush now and then, until a
        // moment picked at random; then the power cut, with the last batch in flight
        // or acknowledged and not flushed, and the kill.
        let end = Instant::now() + Duration::from_millis(200 + next(2300));
        loop {
            let batch = pages.batch(&mut next);
            // (cookie, page, version, FUA) of each write of the batch.
            let mut sent = Vec::new();
            for &p in &batch {
                let v = pages.written(p);
                let flags = if next(32) == 0 { FLAG_FUA } else { 0 };
                c.request(flags, CMD_WRITE, cookie, p * STRIDE, 4096, &block(p, v))
                    .unwrap();
                sent.push((cookie, p, v, flags != 0));
                cookie += 1;
            }
            // The last batch: the cut lands with it in flight, or once it is
            // acknowledged and not flushed (in cache memory only, but for FUA writes).
            let last = Instant::now() >= end;
            let in_flight = last && next(2) == 0;
            if in_flight {
                std::thread::sleep(Duration::from_millis(next(4)));
            } else {
                for _ in 0..batch.len() {
                    let (err, ck) = c.reply().unwrap();
                    assert_eq!(err, 0, "{what}: write {ck} failed");
                    let &(_, p, v, fua) = sent.iter().find(|w| w.0 == ck).expect("a known cookie");
                    if fua {
                        // Acknowledged FUA: durable (on every member it reached).
                        pages.durable_now(p, v);
                    }
                }
            }
            if last {
                // Cache memory loses what no flush or FUA made durable; the kill
                // ends the process as the cut would.
                let out = success("admin power-cut", &admin(&ctl, &["power-cut"]));
                assert!(out.contains("power cut: m"), "{what}: {out}");
                srv.signal(libc::SIGKILL);
                break;
            }
            if next(2) == 0 {
                c.request(0, CMD_FLUSH, cookie, 0, 0, &[]).unwrap();
                c.expect(cookie, 0);
                cookie += 1;
                pages.flushed();
            }
            // Quiet moments, in which the rebuild may copy what the writes touch.
            std::thread::sleep(Duration::from_millis(next(20)));
        }
        let (status, log) = srv.wait_exit();
        assert!(!status.success(), "killed");
        assert!(
            log.contains("power cut of m"),
            "{what}: no power cut:\n{log}"
        );
        logs += &format!("--- {what} (power cut, SIGKILL)\n{log}");
    }
    // Rebuilt and stopped cleanly (the caches wrote everything back): both members
    // hold every page as last read, and the same data.
    pages.members_hold(&a, &b, &logs);
}
