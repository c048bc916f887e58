use super::*;

/// Undoes a mount, a loop device and a FUSE mount, in that order, even on panic.
pub(super) struct Mounted {
    pub(super) umount: PathBuf,
    pub(super) losetup: PathBuf,
    pub(super) fusermount: PathBuf,
    pub(super) mnt: Option<PathBuf>,
    pub(super) loop_dev: Option<String>,
    pub(super) fuse: Option<(PathBuf, Child)>,
}

impl Mounted {
    /// Unmounts the file system.
    pub(super) fn unmount(&mut self) {
        if let Some(m) = self.mnt.clone() {
            retry_busy("umount", || {
                let mut c = Command::new(&self.umount);
                c.arg(&m);
                c
            });
            self.mnt = None;
        }
    }

    pub(super) fn detach(&mut self) {
        if let Some(l) = self.loop_dev.clone() {
            retry_busy("losetup -d", || {
                let mut c = Command::new(&self.losetup);
                c.args(["-d", &l]);
                c
            });
            self.loop_dev = None;
        }
    }

    /// Unmounts the FUSE file; returns nbdfuse's exit status.
    fn unfuse(&mut self) -> Option<ExitStatus> {
        let dir = self.fuse.as_ref()?.0.clone();
        retry_busy("fusermount3 -u", || {
            let mut c = Command::new(&self.fusermount);
            c.arg("-u").arg(&dir);
            c
        });
        let (_, mut child) = self.fuse.take()?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Some(status);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("nbdfuse still running 30 s after fusermount3 -u");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Runs a teardown command until it succeeds. "Busy" can be a passing state (a loop
/// device is released asynchronously; a process of the parallel test run may hold a
/// descriptor it inherited across fork for a moment), so it is retried for 20 s.
pub(super) fn retry_busy(what: &str, make: impl Fn() -> Command) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let out = run_for(&mut make(), Duration::from_secs(60));
        if out.status.success() {
            return;
        }
        if !text(&out.stderr).to_lowercase().contains("busy") || Instant::now() > deadline {
            success(what, &out);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

impl Drop for Mounted {
    /// Whatever is still set up after a panic or a skip goes, quietly.
    fn drop(&mut self) {
        if let Some(m) = self.mnt.take() {
            let _ = Command::new(&self.umount).arg("-l").arg(m).status();
        }
        if let Some(l) = self.loop_dev.take() {
            let _ = Command::new(&self.losetup).args(["-d", &l]).status();
        }
        if let Some((dir, mut child)) = self.fuse.take() {
            let _ = Command::new(&self.fusermount)
                .args(["-u", "-z"])
                .arg(dir)
                .status();
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[test]
fn ext4_on_a_raid10_export_through_nbdfuse_and_a_loop_device() {
    const NAME: &str = "filesystem::ext4_on_a_raid10_export_through_nbdfuse_and_a_loop_device";
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        skip(NAME, "needs root (losetup, mount)");
        return;
    }
    if !Path::new("/dev/fuse").exists() {
        skip(NAME, "/dev/fuse is missing");
        return;
    }
    let Some([nbdfuse, fusermount, losetup, mkfs, fsck, mount, umount]) = tools(
        NAME,
        [
            "nbdfuse",
            "fusermount3",
            "losetup",
            "mkfs.ext4",
            "fsck.ext4",
            "mount",
            "umount",
        ],
    ) else {
        return;
    };
    let probe = run_for(Command::new(&losetup).arg("-f"), Duration::from_secs(30));
    if !probe.status.success() {
        skip(
            NAME,
            &format!("losetup -f: no loop device: {}", text(&probe.stderr).trim()),
        );
        return;
    }

    // RAID10 of four 33 MiB files with superblocks (the default): 32 MiB of data on
    // each, 64 MiB in all.
    let dir = tmpdir();
    let mut toml = String::new();
    for i in 0..4 {
        toml += &format!(
            "[device.d{i}]\ntype = \"file\"\npath = \"{}\"\nsize = \"33M\"\n\n",
            dir.path().join(format!("d{i}.img")).display()
        );
    }
    toml += "[device.r]\ntype = \"raid10\"\nmembers = [\"d0\", \"d1\", \"d2\", \"d3\"]\nchunk = \"64K\"\n";
    let stack = write_stack(&dir, &toml);
    let mut srv = Server::start_in(dir, &[path_str(&stack)]);

    let fuse_dir = srv.path("fuse");
    let mnt = srv.path("mnt");
    std::fs::create_dir(&fuse_dir).unwrap();
    std::fs::create_dir(&mnt).unwrap();
    let pidfile = srv.path("nbdfuse.pid");
    let fuse_log = srv.path("nbdfuse.log");
    let child = Command::new(&nbdfuse)
        .arg("-P")
        .arg(&pidfile)
        .arg(&fuse_dir)
        .arg(srv.uri())
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(srv.path("nbdfuse.out")).unwrap())
        .stderr(std::fs::File::create(&fuse_log).unwrap())
        .spawn()
        .expect("start nbdfuse");
    let mut m = Mounted {
        umount: umount.clone(),
        losetup: losetup.clone(),
        fusermount,
        mnt: None,
        loop_dev: None,
        fuse: Some((fuse_dir.clone(), child)),
    };
    // Ready once the pid file is written.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !std::fs::read_to_string(&pidfile).is_ok_and(|s| !s.trim().is_empty()) {
        let exited = m.fuse.as_mut().unwrap().1.try_wait().unwrap();
        if let Some(status) = exited {
            m.fuse = None;
            let log = std::fs::read_to_string(&fuse_log).unwrap_or_default();
            if log.contains("fuse:") || log.contains("fusermount") {
                skip(NAME, &format!("FUSE cannot mount here: {}", log.trim()));
                return;
            }
            panic!("nbdfuse exited ({status}) before it was ready:\n{log}");
        }
        assert!(Instant::now() < deadline, "nbdfuse not ready after 30 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    let image = fuse_dir.join("nbd");
    assert_eq!(std::fs::metadata(&image).unwrap().len(), 64 << 20);

    let out = run_for(
        Command::new(&losetup)
            .args(["--find", "--show"])
            .arg(&image),
        Duration::from_secs(60),
    );
    if !out.status.success() {
        skip(
            NAME,
            &format!("losetup cannot attach: {}", text(&out.stderr).trim()),
        );
        return;
    }
    let dev = text(&out.stdout).trim().to_string();
    m.loop_dev = Some(dev.clone());
    success(
        "mkfs.ext4",
        &run(Command::new(&mkfs).args(["-q", "-F", &dev])),
    );
    success(
        "mount",
        &run(Command::new(&mount).args(["-t", "ext4", &dev]).arg(&mnt)),
    );
    m.mnt = Some(mnt.clone());
    let files: Vec<(PathBuf, Vec<u8>)> = (0..8)
        .map(|i| {
            let sub = mnt.join(format!("dir{}", i % 3));
            std::fs::create_dir_all(&sub).unwrap();
            (
                sub.join(format!("file{i}")),
                random_bytes((1 << 20) + i * 4096 + 17, 200 + i as u64),
            )
        })
        .collect();
    for (path, data) in &files {
        let mut f = std::fs::File::create(path).unwrap();
        f.write_all(data).unwrap();
        f.sync_all().unwrap();
    }
    std::fs::File::open(&mnt).unwrap().sync_all().unwrap();
    m.unmount();
    let out = run(Command::new(&fsck).args(["-f", "-n", &dev]));
    success("fsck.ext4 -f -n (a clean file system)", &out);
    // Mounted again, read-only: every file reads back.
    success(
        "mount -o ro",
        &run(Command::new(&mount)
            .args(["-t", "ext4", "-o", "ro", &dev])
            .arg(&mnt)),
    );
    m.mnt = Some(mnt.clone());
    for (path, data) in &files {
        assert_same(
            &path.display().to_string(),
            &std::fs::read(path).unwrap(),
            data,
        );
    }
    m.unmount();
    m.detach();
    let status = m.unfuse().expect("nbdfuse was running");
    assert!(status.success(), "nbdfuse exit status {status}");
    let (status, log) = srv.stop();
    assert!(status.success(), "exit status {status}; stderr:\n{log}");
    // md's near layout with four members and two copies: d0 mirrors d1, d2 mirrors d3,
    // in their data areas (after the 1 MiB metadata area, whose superblocks name each
    // member).
    let member =
        |i: usize| std::fs::read(srv.path(&format!("d{i}.img"))).unwrap()[1 << 20..].to_vec();
    assert_same("raid10 members d0 and d1", &member(0), &member(1));
    assert_same("raid10 members d2 and d3", &member(2), &member(3));
    assert!(member(0).iter().any(|&x| x != 0), "nothing reached d0");
}
