//! Raw command-line flags (clap) and their validation into typed settings.

use std::process::ExitCode;
use std::time::Duration;

use cairn_bench::{JobSpec, Pattern};
use cairn_core::size::{parse_duration, parse_size};
use cairn_core::{
    ClockMode, CoalesceMode, DispatchMode, FlushMode, ReapMode, StatsMode, Switches, WritebackMode,
};
use std::path::PathBuf;

use cairn_config::{StackFile, Tuning};
use cairn_leaves::LeafSpec;
use clap::{Args, Parser, Subcommand, ValueEnum};

/// The device `cairn bench` uses when none is given.
pub const DEFAULT_DEVICE: &str = "mem:1G";
/// How long `cairn bench` runs when no length is given.
pub const DEFAULT_RUNTIME_S: u64 = 10;

const ABOUT: &str = "cairn: userspace block storage, served over NBD.

Builds disks from files, block devices, memory, Ceph RBD images and other NBD servers,
stacks them (linear, stripe, mirror, raid10, write-back caches) as a TOML stack file
describes, adds data services (thin pools with snapshots and clones, checkpoints for
incremental backup, LUKS encryption, rate limits), serves them over NBD to qemu,
libnbd's tools, fio and the kernel (or to the kernel as a file through FUSE), and
measures them with a fio-style load generator.";

const GLOBAL_HELP: &str = "Examples:
  cairn serve                                   a 1 GiB memory disk on nbd://127.0.0.1
  cairn serve --device file:disk.img,size=8G    a file (created if missing) as the disk
  cairn serve stack.toml --admin /tmp/cairn.sock
                                                a stack file's exports, with an admin socket
  cairn check stack.toml                        what a stack file would open or create
  cairn admin /tmp/cairn.sock status            a running server's devices, clients, arrays
  cairn bench --device null:1G --time_based --runtime 10
                                                a fio-style load, in process

Performance switches, before or after the command. Each is on by default and turns one
optimisation off, to measure what it gives; a stack file's [tuning] table sets them too,
and these flags win (the README's \"The switches\" has their history and figures):
  --flush batched|serial   one device flush answers every flush request that arrived
                           before it started, or one flush per request, one at a time
  --clock cached|precise   read the clock once per batch of I/O, or at every timestamp
  --writeback per-device|shared
                           each cache writes back on a thread of its own, in offset
                           order, or one shared pool of threads takes pages from every
                           cache in the order they were dirtied
  --dispatch inline|handoff
                           arrays and other stacked devices pass requests to their
                           members on the caller's thread, or through a worker thread
                           at each layer
  --reap eager|lazy        collect completions as soon as they are ready, or only when
                           the thread would otherwise sleep
  --stats on|off           per-device statistics and latency histograms (what status,
                           stat, metrics and bench's report show), or none

More: `cairn COMMAND --help`, `man cairn-COMMAND` (`cairn man DIR` writes the pages),
and README.md.";

const BENCH_HELP: &str =
    "The performance switches (--flush, --clock, --writeback, --dispatch, --reap, --stats)
apply here too: see cairn --help.

A stack file (see `cairn check --help`) names devices and how they stack:
  cairn bench raid10.toml                       the one top-level device in the file
  cairn bench raid10.toml --device d0           one device of the file

Devices (--device, without a stack file):
  null:SIZE[,block=N]          completes at once, reads return zeros
  mem:SIZE[,block=N]           sparse RAM disk
  file:PATH[,engine=auto|io_uring|aio|sync][,direct=0|1][,size=SIZE]
                               regular file or block device; size= creates or extends;
                               auto (the default) picks the engine for its file system
  nbd:URI[,connections=N][,timeout=T]
                               an export of an NBD server (nbd+unix:///?socket=PATH)
  rbd:POOL/[NS/]IMAGE[,conf=PATH][,id=NAME][,snapshot=SNAP][,timeout=T]
                               a Ceph RBD image through librbd (snapshot: read-only)

Options keep fio's names and meanings. The job runs until --runtime passes or each job
has transferred --io_size bytes (default: the region's size), whichever comes first;
--time_based ignores --io_size. With none of --runtime, --size and --io_size, cairn runs
for 10 s. Offsets are uniformly random (fio's norandommap). With --verify and
several jobs, each job gets its own slice of the region.

Exit status: 0 success, 1 an I/O or verification failed, 2 bad arguments.

Examples:
  cairn bench --device null:1G --rw randread --bs 4k --iodepth 32 --time_based --runtime 10
  cairn bench --device file:/dev/shm/a,size=1G,engine=aio --rw randread --time_based --runtime 10
  cairn bench --device mem:256M --rw randwrite --verify crc32c --size 64M
  cairn bench --device file:/tmp/db,size=1G --rw randwrite --iodepth 16 --fsync 1 --time_based --runtime 30
  cairn bench --device file:/tmp/db,size=1G --rw randwrite --fua-every 10 --time_based --runtime 30
  cairn bench --device null:1G --output-format json | jq '.jobs[0].read.iops'";

/// Raw command line.
#[derive(Parser, Debug)]
#[command(name = "cairn", version, about = ABOUT, after_help = GLOBAL_HELP)]
pub struct Cli {
    #[command(flatten)]
    pub global: GlobalArgs,
    #[command(subcommand)]
    pub command: Command,
}

/// Switches that apply to every command.
#[derive(Args, Debug)]
pub struct GlobalArgs {
    /// Events logged on stderr (one line each, with an RFC 3339 time and the level): error,
    /// warn, info (default) or debug; off for none.
    #[arg(long, global = true, value_enum, default_value_t = LogLevel::Info)]
    pub log_level: LogLevel,
    /// Read the clock once per batch of I/O (cached, default) or at every timestamp.
    #[arg(long, global = true, value_enum, hide = true)]
    pub clock: Option<ClockArg>,
    /// Collect completions as soon as they are ready (eager, default) or only when the
    /// thread would otherwise sleep (lazy).
    #[arg(long, global = true, value_enum, hide = true)]
    pub reap: Option<ReapArg>,
    /// Keep per-device statistics and latency histograms (on, default).
    #[arg(long, global = true, value_enum, hide = true)]
    pub stats: Option<OnOff>,
    /// One device flush answers every flush request that arrived before it started
    /// (batched, default), or one flush per request, one at a time (serial).
    #[arg(long, global = true, value_enum, hide = true)]
    pub flush: Option<FlushArg>,
    /// Stacked devices pass requests to their members on the caller's thread (inline,
    /// default) or through a worker thread at each layer (handoff).
    #[arg(long, global = true, value_enum, hide = true)]
    pub dispatch: Option<DispatchArg>,
    /// Each cache writes back on a thread of its own, in offset order (per-device,
    /// default), or one shared pool of threads takes pages from every cache in the order
    /// they were dirtied (shared).
    #[arg(long, global = true, value_enum, hide = true)]
    pub writeback: Option<WritebackArg>,
    /// With many storage requests in flight, a waiting thread wakes when a quarter of
    /// them are done or 10 us have passed (on, default), or at every completion (off).
    #[arg(long, global = true, value_enum, hide = true)]
    pub coalesce: Option<OnOff>,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogLevel {
    Off,
    Error,
    Warn,
    Info,
    Debug,
}

impl LogLevel {
    pub fn filter(self) -> log::LevelFilter {
        match self {
            LogLevel::Off => log::LevelFilter::Off,
            LogLevel::Error => log::LevelFilter::Error,
            LogLevel::Warn => log::LevelFilter::Warn,
            LogLevel::Info => log::LevelFilter::Info,
            LogLevel::Debug => log::LevelFilter::Debug,
        }
    }
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum WritebackArg {
    PerDevice,
    Shared,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DispatchArg {
    Inline,
    Handoff,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlushArg {
    Batched,
    Serial,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClockArg {
    Cached,
    Precise,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReapArg {
    Eager,
    Lazy,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnOff {
    On,
    Off,
}

impl GlobalArgs {
    /// The switches: command-line flags first, then the stack file's `[tuning]`, then the
    /// defaults.
    pub fn switches(&self, tuning: &Tuning) -> Result<Switches, String> {
        let file = tuning.over(Switches::default());
        Ok(Switches {
            clock: match self.clock {
                Some(ClockArg::Cached) => ClockMode::Cached,
                Some(ClockArg::Precise) => ClockMode::Precise,
                None => file.clock,
            },
            reap: match self.reap {
                Some(ReapArg::Eager) => ReapMode::Eager,
                Some(ReapArg::Lazy) => ReapMode::Lazy,
                None => file.reap,
            },
            stats: match self.stats {
                Some(OnOff::On) => StatsMode::On,
                Some(OnOff::Off) => StatsMode::Off,
                None => file.stats,
            },
            flush: match self.flush {
                Some(FlushArg::Batched) => FlushMode::Batched,
                Some(FlushArg::Serial) => FlushMode::Serial,
                None => file.flush,
            },
            dispatch: match self.dispatch {
                Some(DispatchArg::Inline) => DispatchMode::Inline,
                Some(DispatchArg::Handoff) => DispatchMode::Handoff,
                None => file.dispatch,
            },
            writeback: match self.writeback {
                Some(WritebackArg::PerDevice) => WritebackMode::PerDevice,
                Some(WritebackArg::Shared) => WritebackMode::Shared,
                None => file.writeback,
            },
            coalesce: match self.coalesce {
                Some(OnOff::On) => CoalesceMode::On,
                Some(OnOff::Off) => CoalesceMode::Off,
                None => file.coalesce,
            },
        })
    }
}

/// Commands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run a fio-style load against a device and report IOPS, bandwidth and latency.
    #[command(after_help = BENCH_HELP, allow_negative_numbers = true)]
    Bench(Box<BenchArgs>),
    /// Validate a stack file and print its device tree with sizes.
    #[command(after_help = CHECK_HELP)]
    Check(CheckArgs),
    /// Serve devices over NBD (a 1 GiB memory device when no stack file is given).
    #[command(after_help = SERVE_HELP)]
    Serve(Box<ServeArgs>),
    /// Send a command to a running `cairn serve --admin PATH` (`cairn admin help` lists them).
    #[command(after_help = admin_help())]
    Admin(AdminArgs),
    /// Watch a running server's devices, like `iostat -x`: rates per device each interval.
    #[command(after_help = STAT_HELP)]
    Stat(StatArgs),
    /// Write the manual pages (cairn.1, cairn-serve.1, ...) into a directory.
    #[command(after_help = MAN_HELP)]
    Man(ManArgs),
    /// Copy an NBD export into a file: all of it, or only what changed since a checkpoint.
    #[command(after_help = BACKUP_HELP)]
    Backup(BackupArgs),
}

const BACKUP_HELP: &str =
    "A full backup (no --since) makes DEST, or truncates it, to the export's size and
reads only what base:allocation does not report as zeroes (the rest stays a hole). An
incremental backup (--since NAME) asks the export for the context qemu:dirty-bitmap:NAME
and reads only the extents it reports dirty into DEST, which must be an earlier backup of
the same export (same size): it then equals the export. DEST is synced before the
summary line. An incremental backup that fails part way leaves DEST partly updated:
run it again (it reads the same extents) before the next one.

Exit status: 0 done, 1 the copy failed part way (the line says at which offset),
2 refused before anything was written (a flag, the server, the bitmap, DEST).

Examples (the flow of README \"Incremental backup\"; A is cairn admin SOCKET):
  $A checkpoint pool vm1 c1 && $A export add c1 pool c1
  cairn backup 'nbd+unix:///c1?socket=/run/cairn.sock' vm1.img
  $A checkpoint pool vm1 c2 && $A export add c2 pool c2
  cairn backup 'nbd+unix:///c2?socket=/run/cairn.sock' vm1.img --since c1
  cairn backup nbds://backup.example/vm1?tls-certificates=/etc/cairn/pki vm1.img --json";

/// `cairn backup SOURCE DEST`.
#[derive(Debug, Args)]
pub struct BackupArgs {
    /// The export to copy: nbd://HOST[:PORT]/EXPORT, nbds://... (TLS),
    /// nbd+unix:///EXPORT?socket=PATH.
    #[arg(value_name = "SOURCE")]
    pub source: String,
    /// The file to write.
    #[arg(value_name = "DEST")]
    pub dest: PathBuf,
    /// Copy only what changed since the checkpoint (dirty bitmap) NAME, into an earlier
    /// backup.
    #[arg(long, value_name = "NAME")]
    pub since: Option<String>,
    /// Reads in flight (as nbdcopy's --requests) [default: 16, at most 256].
    #[arg(long, value_name = "N")]
    pub depth: Option<usize>,
    /// The longest read; adjacent extents are read together up to it [default: 2M, at
    /// most 32M].
    #[arg(long, value_name = "SIZE")]
    pub request_size: Option<String>,
    /// Block status asked for at once [default: 1G].
    #[arg(long, value_name = "SIZE")]
    pub status_size: Option<String>,
    /// How long the server may stay silent with requests in flight [default: 30s].
    #[arg(long, value_name = "T")]
    pub timeout: Option<String>,
    /// The summary as one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// `cairn backup`, validated.
#[derive(Debug)]
pub struct BackupSettings {
    /// SOURCE as given (for messages).
    pub source_text: String,
    /// SOURCE parsed.
    pub source: cairn_nbd::uri::NbdUri,
    pub dest: PathBuf,
    pub since: Option<String>,
    pub pull: cairn_nbd::client::pull::Options,
    pub json: bool,
}

impl BackupArgs {
    /// The settings, or one line saying which flag is wrong.
    pub fn settings(&self) -> Result<BackupSettings, String> {
        use cairn_nbd::client::pull;
        let source = cairn_nbd::uri::NbdUri::parse(&self.source)
            .map_err(|e| format!("backup: SOURCE {e}"))?;
        let depth = self.depth.unwrap_or(16);
        if !(1..=pull::DEPTH_MAX).contains(&depth) {
            return Err(format!(
                "backup: --depth {depth} is out of range (1 to {})",
                pull::DEPTH_MAX
            ));
        }
        let size = |flag: &str, v: &Option<String>, default: u64, min: u64, max: u64| {
            let n = match v {
                Some(t) => parse_size(t).map_err(|e| format!("backup: --{flag} {t}: {e}"))?,
                None => default,
            };
            if !(min..=max).contains(&n) {
                return Err(format!(
                    "backup: --{flag} {n} is out of range ({min} to {max} bytes)"
                ));
            }
            Ok(n)
        };
        let request_bytes = size(
            "request-size",
            &self.request_size,
            2 << 20,
            512,
            pull::REQUEST_MAX,
        )?;
        let status_bytes = size(
            "status-size",
            &self.status_size,
            pull::STATUS_DEFAULT,
            64 << 10,
            u64::MAX,
        )?;
        let timeout = match &self.timeout {
            Some(t) => parse_duration(t).map_err(|e| format!("backup: --timeout {t}: {e}"))?,
            None => Duration::from_secs(30),
        };
        if timeout < Duration::from_millis(100) {
            return Err(format!(
                "backup: --timeout {timeout:?} is too short (at least 100ms)"
            ));
        }
        if let Some(name) = &self.since {
            if name.is_empty() || name.len() > 4000 || name.chars().any(char::is_control) {
                return Err(format!("backup: --since {name:?} is not a bitmap name"));
            }
        }
        Ok(BackupSettings {
            source_text: self.source.clone(),
            source,
            dest: self.dest.clone(),
            since: self.since.clone(),
            pull: pull::Options {
                depth,
                request_bytes,
                status_bytes,
                timeout,
            },
            json: self.json,
        })
    }
}

const MAN_HELP: &str = "Examples:
  cairn man ~/.local/share/man/man1             then: man cairn-serve
  cairn man /usr/local/share/man/man1 && mandb -q";

/// `cairn man DIR`.
#[derive(Debug, Args)]
pub struct ManArgs {
    /// Where to write the pages (created if missing; pages there are replaced).
    #[arg(value_name = "DIR")]
    pub dir: PathBuf,
}

const STAT_HELP: &str = "Columns, per device, over each interval (write-zeroes count as writes):
  r/s w/s      reads and writes completed a second
  rMB/s wMB/s  megabytes (10^6) read and written a second
  r_await      mean read latency, milliseconds (w_await: writes)
  aqu-sz       mean requests in flight (the sum of latencies over the interval)
  %util        share of the interval with at least one request in flight (a lower
               bound for devices served by several reactors)
On a terminal the table is redrawn each interval; piped, each interval prints one line
per device, prefixed with the time.

Example:
  cairn serve stack.toml --admin /run/cairn.sock &
  cairn stat /run/cairn.sock 1";

/// `cairn stat SOCKET [INTERVAL]`.
#[derive(Debug, Args)]
pub struct StatArgs {
    /// The socket given to `cairn serve --admin` (or `cairn bench --admin`).
    #[arg(value_name = "SOCKET")]
    pub socket: PathBuf,
    /// Time between reports (1, 1s, 500ms) [default: 1s].
    #[arg(value_name = "INTERVAL")]
    pub interval: Option<String>,
    /// Stop after this many reports (default: until interrupted, or the server stops).
    #[arg(long, value_name = "N")]
    pub count: Option<u64>,
}

/// `cairn admin --help`'s text after the options: the commands, from the one list.
fn admin_help() -> String {
    format!(
        "Commands:\n{}\n`cairn admin help` prints this list without a server.\n\nExample:\n  \
         cairn serve --admin /run/cairn.admin examples/hdd-caches.toml &\n  \
         cairn admin /run/cairn.admin power-cut c0",
        crate::admin::help_text()
    )
}

/// `cairn admin` arguments.
#[derive(Args, Debug)]
pub struct AdminArgs {
    /// The socket given to `cairn serve --admin` (or `cairn bench --admin`); `help` alone
    /// lists the commands.
    #[arg(value_name = "SOCKET")]
    pub socket: PathBuf,
    /// The command and its arguments.
    #[arg(value_name = "COMMAND", num_args = 0.., trailing_var_arg = true, allow_hyphen_values = true)]
    pub command: Vec<String>,
}

/// The device `cairn serve` offers when neither a stack file nor --device is given.
pub const DEFAULT_SERVE_DEVICE: &str = "mem:1G";
/// Where `cairn serve` listens by default: loopback only.
pub const DEFAULT_LISTEN: &str = "tcp:127.0.0.1:10809";

const SERVE_HELP: &str =
    "The performance switches (--flush, --clock, --writeback, --dispatch, --reap, --stats)
apply here too: see cairn --help.

Exports:
  cairn serve                                   mem:1G as export \"\" on 127.0.0.1:10809
  cairn serve --device file:/srv/disk.img       one leaf device as export \"\"
  cairn serve stack.toml                        the file's [export.NAME] tables, or its
                                                single top-level device as export \"\"

An export table names a top-level device:
  [export.vm1]
  device = \"r\"          # required
  read_only = false     # writes, trims and write-zeroes fail with EPERM when true
  description = \"...\"   # shown by nbdinfo --list
  default = true        # chosen by clients that ask for the empty name
  strict_alignment = false  # true: refuse (EINVAL) requests not aligned to the device's
                        # blocks even from clients that did not ask for block sizes,
                        # instead of serving them by read-modify-write

TLS: --tls-certificates DIR offers STARTTLS (server-cert.pem, server-key.pem; clients use
nbds:// URIs); --tls require refuses every option but STARTTLS before TLS is up.

Listening: --listen tcp:HOST:PORT and --listen unix:PATH, repeatable (default
tcp:127.0.0.1:10809: loopback only). Sockets passed by systemd (LISTEN_FDS) are used too.
SIGTERM or SIGINT: stop accepting, finish requests in flight, flush, answer later requests
with ESHUTDOWN, close, exit 0.

Examples:
  cairn serve &  nbdinfo nbd://127.0.0.1
  cairn serve --listen unix:/tmp/nbd.sock examples/raid10.toml
  nbdcopy disk.img nbd+unix:///?socket=/tmp/nbd.sock";

/// `cairn serve` arguments.
#[derive(Args, Debug)]
pub struct ServeArgs {
    /// A stack file with [device.NAME] and [export.NAME] tables.
    #[arg(value_name = "STACK.toml")]
    pub stack: Option<PathBuf>,
    /// Serve this device as export "": a leaf spec (mem:1G, file:PATH,...) or, with a
    /// stack file, a device of the file.
    #[arg(long, value_name = "DEVICE")]
    pub device: Option<String>,
    /// Serve every export read-only (writes, trims and write-zeroes fail with EPERM),
    /// whatever the stack file's export tables say.
    #[arg(long)]
    pub read_only: bool,
    /// With --device, or a stack file without export tables (set strict_alignment in
    /// the tables otherwise): refuse requests not aligned to the device's blocks (EINVAL) even
    /// from clients that did not ask for block sizes, instead of serving them by
    /// read-modify-write.
    #[arg(long)]
    pub strict_alignment: bool,
    /// tcp:HOST:PORT or unix:PATH; repeatable.
    #[arg(long, value_name = "ADDR")]
    pub listen: Vec<String>,
    /// Serve one connection on standard input, a socket (inetd style; nbdkit's -s), and
    /// exit once it ends: for libnbd's connect_command (nbdsh -c, nbdinfo -- [ CMD ]).
    /// Nothing is printed on standard output; no address is listened on.
    #[arg(long, short = 's')]
    pub stdio: bool,
    /// Reactor threads (default: one per CPU).
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
    /// Largest read or write payload a client may send (advertised as the maximum block
    /// size; clients that do not ask for it may still send up to this much).
    #[arg(long, value_name = "SIZE", default_value = "64M")]
    pub max_payload: String,
    /// Data buffer memory per connection.
    #[arg(long, value_name = "SIZE", default_value = "64M")]
    pub buffer_memory: String,
    /// Data buffer memory of all connections together: requests in flight, replies not
    /// yet sent, buffers kept for reuse. A write's payload is charged as it arrives; when
    /// the budget is spent, connections that need more stop being read until memory comes
    /// back. Default: an eighth of the machine's memory. At least twice the reserve, which
    /// is --max-payload plus 2 MiB rounded up to a power of two.
    #[arg(long, value_name = "SIZE")]
    pub memory_budget: Option<String>,
    /// Connections served at once (handshakes included). At the limit, an idle connection
    /// gives up its slot to a new one (see --evict-idle-after); else the new one is
    /// refused. An idle connection holds about 12 KiB; lowered at start to what the
    /// descriptor limit (RLIMIT_NOFILE, raised to its hard limit) allows.
    #[arg(long, value_name = "N", default_value_t = 4096)]
    pub max_connections: usize,
    /// Connections served at once from one client: one IP address over TCP, one user id
    /// over a Unix socket. At the limit, that client's connection idle longest gives up
    /// its slot (see --evict-idle-after); else the new one is refused.
    #[arg(long, value_name = "N", default_value_t = 32)]
    pub max_connections_per_address: usize,
    /// At a connection limit, a quiet connection (nothing at the device, no request partly
    /// received, no reply waiting to be read) idle this long (or --idle-timeout, if
    /// shorter) is closed to make room for a new one; one in the middle of a request or
    /// reply only after --idle-timeout. The server being full, it is one of the client
    /// holding the most connections, its longest idle. 0: only after --idle-timeout.
    #[arg(long, value_name = "TIME", default_value = "10s")]
    pub evict_idle_after: String,
    /// A connection with nothing at the device that sent no new request and had none
    /// answered for this long is idle (bytes trickled within a request do not count):
    /// it gives up its slot to a new client that needs it (and, with --idle-close, is
    /// closed at once). 0: never.
    #[arg(long, value_name = "TIME", default_value = "5m")]
    pub idle_timeout: String,
    /// Close connections as soon as they are idle for --idle-timeout, not only when their
    /// slot is needed. Kernel (nbd-client) and most qemu configurations do not reconnect:
    /// their disks then fail.
    #[arg(long)]
    pub idle_close: bool,
    /// Options one handshake may send.
    #[arg(long, value_name = "N", default_value_t = 64)]
    pub max_options: u32,
    /// Longest a handshake may take.
    #[arg(long, value_name = "TIME", default_value = "10s")]
    pub handshake_timeout: String,
    /// Longest the shutdown after SIGTERM may take (requests in flight finishing, caches
    /// written back); after it cairn says what it abandons and exits with status 1.
    #[arg(long, value_name = "TIME", default_value = "30s")]
    pub shutdown_timeout: String,
    /// Idle polling: before a reactor sleeps it keeps looking for new requests and
    /// completions this long, saving a sleep and a wake-up per round trip when a client
    /// answers quickly (iodepth 1 reads from mem: 19k -> 41k IOPS here; iodepth 32 with
    /// cairn's client: 1.1x-2x on mem, tmpfs, ext4 and a loop device), at the price of up
    /// to this much CPU after each burst; a poll that finds nothing makes the next ones
    /// rarer. 0 turns it off (sleep at once).
    #[arg(long, value_name = "TIME", default_value = "50us")]
    pub idle_poll: String,
    /// TLS: off, on (offered through STARTTLS), or require (nothing but STARTTLS before
    /// TLS is up). Default: on when --tls-certificates is given, else off.
    #[arg(long, value_enum)]
    pub tls: Option<TlsArg>,
    /// Directory with server-cert.pem and server-key.pem (and ca-cert.pem for
    /// --tls-verify-peer), laid out as for nbdkit and QEMU.
    #[arg(long, value_name = "DIR")]
    pub tls_certificates: Option<PathBuf>,
    /// Require client certificates signed by ca-cert.pem.
    #[arg(long)]
    pub tls_verify_peer: bool,
    /// Listen for admin commands (`cairn admin PATH help`) on this Unix socket, which
    /// only its owner may use.
    #[arg(long, value_name = "PATH")]
    pub admin: Option<PathBuf>,
    /// Serve Prometheus metrics (GET /metrics) at tcp:HOST:PORT or unix:PATH, e.g.
    /// tcp:127.0.0.1:9187 (port 0: any free port, named in the log).
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<String>,
    /// Also mount export EXPORT (default: the one served without a name) as a regular
    /// file at PATH, created if missing, for losetup, mkfs, qemu-img and dd; repeatable.
    /// Needs root. Without --listen, NBD is then not served.
    #[arg(long, value_name = "PATH[:EXPORT]")]
    pub fuse: Vec<String>,
    /// FUSE requests through io_uring when the kernel offers it (auto; the fuse module's
    /// enable_uring must be Y), or through /dev/fuse reads (off).
    #[arg(long, value_enum, default_value = "auto")]
    pub fuse_io_uring: FuseUringArg,
    /// FUSE requests in flight per reactor (/dev/fuse) or per io_uring queue; each takes a
    /// buffer of 1 MiB.
    #[arg(long, value_name = "N", default_value_t = 32)]
    pub fuse_depth: u32,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum FuseUringArg {
    Auto,
    Off,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum TlsArg {
    Off,
    On,
    Require,
}

/// Validated `serve` limits.
pub struct ServeLimits {
    pub idle_poll_ns: u64,
    pub max_payload: u32,
    pub buffer_bytes: usize,
    pub handshake_timeout: Duration,
    pub shutdown_timeout: Duration,
    pub threads: usize,
    pub idle_timeout: Option<Duration>,
    pub evict_idle_after: Option<Duration>,
    pub memory_budget: usize,
}

impl ServeArgs {
    pub fn limits(&self) -> Result<ServeLimits, String> {
        let max_payload = parse_size(&self.max_payload)
            .map_err(|e| format!("--max-payload {}: {e}", self.max_payload))?;
        if !(4096..=(1 << 30)).contains(&max_payload) {
            return Err(format!(
                "--max-payload {}: must be from 4K to 1G",
                self.max_payload
            ));
        }
        let buffer_bytes = parse_size(&self.buffer_memory)
            .map_err(|e| format!("--buffer-memory {}: {e}", self.buffer_memory))?;
        if buffer_bytes < max_payload {
            return Err(format!(
                "--buffer-memory {}: must hold at least one --max-payload ({})",
                self.buffer_memory, self.max_payload
            ));
        }
        let reserve = (max_payload + (2 << 20)).next_power_of_two();
        let memory_budget = match &self.memory_budget {
            Some(m) => {
                let b = parse_size(m).map_err(|e| format!("--memory-budget {m}: {e}"))?;
                if b < 2 * reserve {
                    return Err(format!(
                        "--memory-budget {m}: must be at least {} MiB: twice the reserve of one --max-payload ({}) request",
                        (2 * reserve) >> 20,
                        self.max_payload
                    ));
                }
                b
            }
            None => (physical_memory() / 8).max(2 * reserve),
        };
        let handshake_timeout = parse_duration(&self.handshake_timeout)
            .map_err(|e| format!("--handshake-timeout {}: {e}", self.handshake_timeout))?;
        if handshake_timeout.is_zero() {
            return Err("--handshake-timeout must be more than 0".into());
        }
        let shutdown_timeout = parse_duration(&self.shutdown_timeout)
            .map_err(|e| format!("--shutdown-timeout {}: {e}", self.shutdown_timeout))?;
        if shutdown_timeout.is_zero() {
            return Err("--shutdown-timeout must be more than 0".into());
        }
        if self.max_connections == 0 {
            return Err("--max-connections must be at least 1".into());
        }
        if self.max_connections_per_address == 0 {
            return Err("--max-connections-per-address must be at least 1".into());
        }
        let idle_timeout = parse_duration(&self.idle_timeout)
            .map_err(|e| format!("--idle-timeout {}: {e}", self.idle_timeout))?;
        if self.idle_close && idle_timeout.is_zero() {
            return Err("--idle-close needs an --idle-timeout other than 0".into());
        }
        let evict_idle_after = parse_duration(&self.evict_idle_after)
            .map_err(|e| format!("--evict-idle-after {}: {e}", self.evict_idle_after))?;
        if self.max_options == 0 {
            return Err("--max-options must be at least 1".into());
        }
        let threads = match self.threads {
            Some(0) => return Err("--threads must be at least 1".into()),
            Some(n) if n > 256 => return Err("--threads must be at most 256".into()),
            Some(n) => n,
            None => std::thread::available_parallelism().map_or(1, |n| n.get()),
        };
        let idle_poll = parse_duration(&self.idle_poll)
            .map_err(|e| format!("--idle-poll {}: {e}", self.idle_poll))?;
        if idle_poll > Duration::from_millis(10) {
            return Err(format!("--idle-poll {}: at most 10ms", self.idle_poll));
        }
        Ok(ServeLimits {
            idle_poll_ns: idle_poll.as_nanos() as u64,
            max_payload: max_payload as u32,
            buffer_bytes: buffer_bytes as usize,
            handshake_timeout,
            shutdown_timeout,
            threads,
            idle_timeout: (!idle_timeout.is_zero()).then_some(idle_timeout),
            evict_idle_after: (!evict_idle_after.is_zero()).then_some(evict_idle_after),
            memory_budget: memory_budget as usize,
        })
    }
}

/// The machine's memory in bytes (1 GiB if the kernel does not say).
fn physical_memory() -> u64 {
    // What sysconf(_SC_PHYS_PAGES) * sysconf(_SC_PAGESIZE) gives: the total RAM sysinfo
    // reports, in whole pages.
    let info = rustix::system::sysinfo();
    let size = rustix::param::page_size() as u64;
    let pages = (info.totalram as u64).saturating_mul(u64::from(info.mem_unit)) / size;
    if pages > 0 {
        pages * size
    } else {
        1 << 30
    }
}

const CHECK_HELP: &str =
    "Exit status: 0 the stack file is valid and every device opened, 2 otherwise
(one line on stderr naming the device and the key).

Example:
  cairn check examples/raid10.toml";

/// `cairn check` arguments.
#[derive(Args, Debug)]
pub struct CheckArgs {
    /// The stack file.
    #[arg(value_name = "STACK.toml")]
    pub stack: PathBuf,
    /// Print only this device's tree.
    #[arg(long, value_name = "NAME")]
    pub device: Option<String>,
    /// Open thin pool POOL although its log is damaged, keeping what replays up to the
    /// damage and dropping the commits after it (writes the pool's metadata; see the
    /// README's "Damaged metadata"). Then check as usual.
    #[arg(long, value_name = "POOL")]
    pub repair_thin: Option<String>,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputFormat {
    Normal,
    Json,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum VerifyArg {
    Crc32c,
}

/// `cairn bench` flags, named as fio names them.
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Print throughput, dirty bytes and write-back rate every interval (e.g. 1s) on
    /// stderr.
    #[arg(long, value_name = "TIME")]
    pub timeline: Option<String>,
    /// With --timeline: also write the rows to this CSV file.
    #[arg(long, value_name = "FILE")]
    pub timeline_csv: Option<PathBuf>,
    /// With --timeline: also draw the rows as an SVG chart in this file.
    #[arg(long, value_name = "FILE")]
    pub timeline_svg: Option<PathBuf>,
    /// A stack file; the job runs on its one top-level device, or on --device NAME.
    #[arg(value_name = "STACK.toml")]
    pub stack: Option<PathBuf>,
    /// Without a stack file: the device spec (default mem:1G). With one: a device name.
    #[arg(long, value_name = "SPEC|NAME")]
    pub device: Option<String>,
    /// I/O pattern: read, write, randread, randwrite, rw (readwrite) or randrw.
    #[arg(long, default_value = "randread")]
    pub rw: String,
    /// Percentage of reads in rw and randrw.
    #[arg(long, default_value_t = 50, value_name = "PERCENT")]
    pub rwmixread: u32,
    /// Bytes per request (4k, 64k, 1M, ...).
    #[arg(long, default_value = "4k", value_name = "SIZE")]
    pub bs: String,
    /// Requests each job keeps in flight.
    #[arg(long, default_value_t = 32, value_name = "N")]
    pub iodepth: u32,
    /// Jobs, each on its own reactor thread.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub numjobs: u32,
    /// Stop after this long, ramp excluded (10, 10s, 500ms, 2m).
    #[arg(long, value_name = "TIME")]
    pub runtime: Option<String>,
    /// Run for the whole --runtime even once --io_size is done.
    #[arg(long = "time_based")]
    pub time_based: bool,
    /// Run this long before measuring.
    #[arg(long = "ramp_time", value_name = "TIME")]
    pub ramp_time: Option<String>,
    /// Length of the region (default: from --offset to the device's end).
    #[arg(long, value_name = "SIZE")]
    pub size: Option<String>,
    /// Start of the region.
    #[arg(long, default_value = "0", value_name = "SIZE")]
    pub offset: String,
    /// Bytes each job transfers (default: the region's size).
    #[arg(long = "io_size", value_name = "SIZE")]
    pub io_size: Option<String>,
    /// Each in-flight slot flushes after every N of its own writes and waits for it.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub fsync: u32,
    /// Every Nth write of each job carries FUA (durable when it completes); 0: none.
    /// (fio's `writefua` is all or nothing, and only for its sg and io_uring_cmd engines.)
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub fua_every: u32,
    /// Write self-checking blocks and check every read of them; a mismatch exits 1.
    #[arg(long, value_enum)]
    pub verify: Option<VerifyArg>,
    /// Seed for random offsets.
    #[arg(long, value_name = "N")]
    pub randseed: Option<u64>,
    /// Idle polling, as for `cairn serve`: before a job's reactor sleeps it keeps
    /// collecting completions this long (e.g. 20us), saving a sleep and a wake-up when
    /// they come quickly (an NBD server's replies; reads of a file that io_uring hands
    /// to its worker threads, as on tmpfs) for up to this much CPU after each burst.
    /// Off by default.
    #[arg(long, value_name = "TIME", default_value = "0")]
    pub idle_poll: String,
    /// Report format.
    #[arg(long = "output-format", value_enum, default_value_t = OutputFormat::Normal)]
    pub output_format: OutputFormat,
    /// Listen for admin commands on this Unix socket while the job runs, as `cairn serve
    /// --admin` does (e.g. fail, add or replace array members under a --verify load).
    #[arg(long, value_name = "PATH")]
    pub admin: Option<PathBuf>,
    /// Serve Prometheus metrics (GET /metrics) at tcp:HOST:PORT or unix:PATH, e.g.
    /// tcp:127.0.0.1:9187 (port 0: any free port, named in the log).
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<String>,
}

impl BenchArgs {
    /// Validates the flags into a job, the device to open and a report format.
    pub fn settings(&self) -> Result<(JobSpec, DeviceChoice, OutputFormat), String> {
        let size = |flag: &str, v: &str| parse_size(v).map_err(|e| format!("--{flag}: {e}"));
        let duration =
            |flag: &str, v: &str| parse_duration(v).map_err(|e| format!("--{flag}: {e}"));
        let device = match &self.stack {
            Some(path) => DeviceChoice::Stack {
                path: path.clone(),
                name: self.device.clone(),
            },
            None => DeviceChoice::Leaf(
                LeafSpec::parse(self.device.as_deref().unwrap_or(DEFAULT_DEVICE))
                    .map_err(|e| e.to_string())?,
            ),
        };
        let mut spec = JobSpec {
            rw: Pattern::parse(&self.rw)?,
            rwmixread: self.rwmixread,
            bs: size("bs", &self.bs)?,
            iodepth: self.iodepth,
            numjobs: self.numjobs,
            runtime: self
                .runtime
                .as_deref()
                .map(|v| duration("runtime", v))
                .transpose()?,
            time_based: self.time_based,
            ramp_time: self
                .ramp_time
                .as_deref()
                .map(|v| duration("ramp_time", v))
                .transpose()?
                .unwrap_or(Duration::ZERO),
            offset: size("offset", &self.offset)?,
            size: self.size.as_deref().map(|v| size("size", v)).transpose()?,
            io_size: self
                .io_size
                .as_deref()
                .map(|v| size("io_size", v))
                .transpose()?,
            fsync: self.fsync,
            fua_every: self.fua_every,
            verify: self.verify.is_some(),
            timeline: self
                .timeline
                .as_deref()
                .map(|v| duration("timeline", v))
                .transpose()?,
            timeline_csv: self.timeline_csv.clone(),
            timeline_svg: self.timeline_svg.clone(),
            idle_poll: duration("idle-poll", &self.idle_poll)?,
            ..JobSpec::default()
        };
        if spec.idle_poll > Duration::from_millis(10) {
            return Err(format!("--idle-poll {}: at most 10ms", self.idle_poll));
        }
        if spec
            .timeline
            .is_some_and(|t| t < Duration::from_millis(100))
        {
            return Err("--timeline: at least 100ms".into());
        }
        if spec.timeline_csv.is_some() && spec.timeline.is_none() {
            return Err("--timeline-csv needs --timeline SECS".into());
        }
        if spec.timeline_svg.is_some() && spec.timeline.is_none() {
            return Err("--timeline-svg needs --timeline SECS".into());
        }
        if let Some(seed) = self.randseed {
            spec.randseed = seed;
        }
        if spec.runtime.is_none() && spec.size.is_none() && spec.io_size.is_none() {
            spec.runtime = Some(Duration::from_secs(DEFAULT_RUNTIME_S));
            spec.time_based = true;
        }
        if spec.time_based && spec.runtime.is_none() {
            return Err("--time_based needs --runtime".into());
        }
        Ok((spec, device, self.output_format))
    }
}

/// Where `cairn bench` gets its device.
#[derive(Debug)]
pub enum DeviceChoice {
    /// A leaf spec from `--device`.
    Leaf(LeafSpec),
    /// A device of a stack file.
    Stack {
        /// The file.
        path: PathBuf,
        /// The device, if named.
        name: Option<String>,
    },
}

/// Reads and parses a stack file.
pub fn read_stack(path: &std::path::Path) -> Result<StackFile, String> {
    use std::io::Read;
    let max = cairn_config::limits::FILE_BYTES_MAX;
    let cannot = |e: std::io::Error| format!("cannot read stack file {}: {e}", path.display());
    // Bounded: a stack file is small, and `/dev/zero` never ends.
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(max + 1).read_to_end(&mut bytes))
        .map_err(cannot)?;
    if bytes.len() as u64 > max {
        return Err(format!(
            "{}: the stack file is longer than {max} bytes",
            path.display()
        ));
    }
    let text = String::from_utf8(bytes).map_err(|e| {
        format!(
            "{}: the stack file is not UTF-8 text (byte {} is not)",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })?;
    let stack = StackFile::parse(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    // Relative paths in it are relative to it.
    Ok(stack.relative_to(path.parent().unwrap_or(std::path::Path::new(""))))
}

/// `cairn COMMAND` when the command line names one (for errors clap prints no usage
/// with, such as an invalid value).
fn command_in_argv() -> Option<String> {
    use clap::CommandFactory;
    let cli = Cli::command();
    std::env::args().skip(1).find_map(|a| {
        cli.get_subcommands()
            .any(|c| c.get_name() == a)
            .then(|| format!("cairn {a}"))
    })
}

/// Ends the process for a clap error: help and version go to stdout with status 0;
/// anything else is one line on stderr with status 2.
pub fn clap_exit(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    match e.kind() {
        ErrorKind::DisplayHelp
        | ErrorKind::DisplayVersion
        | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            let _ = e.print();
            if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            }
        }
        _ => {
            let rendered = e.render().to_string();
            let mut lines = rendered.lines();
            let first = lines.next().unwrap_or("invalid arguments");
            let first = first.strip_prefix("error: ").unwrap_or(first);
            // What a message ending in ':' lists (the missing arguments), on its line.
            let listed: Vec<&str> = lines
                .clone()
                .take_while(|l| !l.trim().is_empty())
                .map(str::trim)
                .collect();
            let message = if first.ends_with(':') && !listed.is_empty() {
                format!("{first} {}", listed.join(", "))
            } else {
                first.to_string()
            };
            // The command whose help to see: from the usage line.
            let command = lines
                .find_map(|l| l.trim().strip_prefix("Usage: "))
                .map(|u| {
                    u.split_whitespace()
                        .take_while(|w| !w.starts_with(['[', '<']))
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .filter(|c| !c.is_empty())
                .or_else(command_in_argv)
                .unwrap_or_else(|| "cairn".into());
            eprintln!("cairn: {message} (see {command} --help)");
            ExitCode::from(2)
        }
    }
}
