//! The admin socket's connections: each command on a thread of its own, at most
//! [`COMMANDS_MAX`] at once, and a command line read whole (a refusal must reach the
//! client). What the commands do is in [`crate::admin`].
//!
//! Commands never wait for each other: a slow one (a key slot's derivation, seconds by
//! design) holds up nothing but its own client. The server's stop waits only for the
//! commands that hold devices, never for slow work that holds none (see [`Ticket`]), so
//! a shutdown closes every device itself, cleanly, whatever the admin is doing.

use std::cell::Cell;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// Most admin commands that run at once; one more is refused (each holds a thread and a
/// connection until it ends).
pub const COMMANDS_MAX: usize = 8;

/// Longest command line read, newline included.
pub const MAX_LINE: u64 = 1024;

/// Most bytes read past a command line too long, to find its end: the refusal then
/// reaches a client that sent a few KiB, which the reset of a socket closed with unread
/// bytes would lose.
const DRAIN_MAX: u64 = 64 << 10;

/// How long a client may take to send its command, and to take the reply.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(5);

/// The commands running: how many, how many of them hold devices, and whether the
/// server is stopping.
#[derive(Debug, Default)]
pub struct Workers {
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct State {
    running: usize,
    holding: usize,
    stopping: bool,
}

impl Workers {
    /// Admits one more command, holding devices, or says why not.
    pub fn admit(self: &Arc<Self>) -> Result<Ticket, String> {
        let mut s = self.lock();
        if s.stopping {
            return Err("the server is stopping".into());
        }
        if s.running >= COMMANDS_MAX {
            return Err(format!(
                "{COMMANDS_MAX} admin commands are running already (the most at once): try \
                 again when one has ended"
            ));
        }
        s.running += 1;
        s.holding += 1;
        debug_assert!(
            s.holding <= s.running,
            "more commands hold devices than run"
        );
        Ok(Ticket {
            workers: Some(self.clone()),
            holding: Cell::new(true),
        })
    }

    /// No command takes devices from now on; returns once none holds any (commands in
    /// slow work that needs no device go on until the process ends).
    pub fn stop(&self) {
        let mut s = self.lock();
        s.stopping = true;
        while s.holding > 0 {
            s = self.changed.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One running command's place among the [`Workers`]: it holds devices (from the
/// server's view) unless it has let go of them for slow work. Dropped when the command
/// ends.
#[derive(Debug)]
pub struct Ticket {
    /// `None`: a command run outside the socket (a unit test).
    workers: Option<Arc<Workers>>,
    holding: Cell<bool>,
}

impl Ticket {
    /// A ticket that counts nothing: for a command run outside the admin socket.
    #[cfg(test)]
    pub fn detached() -> Ticket {
        Ticket {
            workers: None,
            holding: Cell::new(true),
        }
    }

    /// The command holds no device now (it has dropped every one it took) and starts
    /// slow work: the server's stop does not wait for it.
    pub fn let_go(&self) {
        if let Some(w) = &self.workers {
            if self.holding.replace(false) {
                let mut s = w.lock();
                s.holding -= 1;
                w.changed.notify_all();
            }
        }
    }

    /// The command takes devices again after slow work: refused once the server is
    /// stopping (its devices are closing).
    pub fn take_again(&self) -> Result<(), String> {
        if let Some(w) = &self.workers {
            if !self.holding.get() {
                let mut s = w.lock();
                if s.stopping {
                    return Err("the server is stopping".into());
                }
                s.holding += 1;
                self.holding.set(true);
            }
        }
        Ok(())
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(w) = &self.workers {
            let mut s = w.lock();
            debug_assert!(s.running > 0, "a command ended twice");
            s.running -= 1;
            if self.holding.get() {
                s.holding -= 1;
            }
            w.changed.notify_all();
        }
    }
}

/// Reads one command line (at most [`MAX_LINE`] bytes, up to a newline or the end of
/// what the client sends). A line too long is read on to its end (at most [`DRAIN_MAX`]
/// more bytes) before it is refused, so that the refusal reaches the client.
pub fn read_command(conn: &UnixStream) -> Result<String, String> {
    let mut reader = BufReader::new(conn);
    let mut line = Vec::new();
    (&mut reader)
        .take(MAX_LINE)
        .read_until(b'\n', &mut line)
        .map_err(|e| e.to_string())?;
    if !line.ends_with(b"\n") && line.len() as u64 >= MAX_LINE {
        let mut rest = Vec::new();
        let _ = reader.take(DRAIN_MAX).read_until(b'\n', &mut rest);
        return Err(format!(
            "command longer than {MAX_LINE} bytes (a command line is at most 1 KiB)"
        ));
    }
    String::from_utf8(line).map_err(|_| "not UTF-8".to_string())
}

/// Refuses connection `conn` with `why` (its command read first, see [`read_command`]).
pub fn refuse(conn: UnixStream, why: &str) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(1)));
    let _ = conn.set_write_timeout(Some(Duration::from_secs(1)));
    let _ = read_command(&conn);
    let refused = crate::admin_error::AdminError::NotTaken(why.to_string());
    reply(conn, &crate::admin_error::reply(Err(refused)));
}

/// Sends `text` and closes the connection.
pub fn reply(mut conn: UnixStream, text: &str) {
    let _ = conn.write_all(text.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_beyond_the_most_are_refused_and_stop_waits_only_for_devices_held() {
        let w = Arc::new(Workers::default());
        let tickets: Vec<Ticket> = (0..COMMANDS_MAX).map(|_| w.admit().unwrap()).collect();
        let e = w.admit().unwrap_err();
        assert!(e.contains("running already"), "{e}");
        // Every command but one lets go of its devices: stop waits for that one only.
        for t in &tickets[1..] {
            t.let_go();
        }
        let mut tickets = tickets;
        let holder = tickets.remove(0);
        std::thread::scope(|s| {
            let stopped = s.spawn(|| w.stop());
            std::thread::sleep(Duration::from_millis(50));
            assert!(
                !stopped.is_finished(),
                "stop did not wait for a device held"
            );
            drop(holder);
            stopped.join().unwrap();
        });
        // A command done with its slow work may not take devices again.
        let e = tickets[0].take_again().unwrap_err();
        assert!(e.contains("stopping"), "{e}");
        assert!(w.admit().is_err());
        drop(tickets);
        assert_eq!(w.lock().running, 0);
    }

    #[test]
    fn a_line_too_long_is_read_to_its_end_and_refused() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let mut sent = vec![b'x'; 3000];
        sent.push(b'\n');
        b.write_all(&sent).unwrap();
        b.write_all(b"status\n").unwrap();
        let e = read_command(&a).unwrap_err();
        assert!(e.contains("longer than 1024 bytes"), "{e}");
        let (a, mut b) = UnixStream::pair().unwrap();
        b.write_all(b"status --json\n").unwrap();
        assert_eq!(read_command(&a).unwrap(), "status --json\n");
    }
}
