//! The local spool: where a job goes when the broker cannot confirm it, until it can.
//!
//! A spool is a directory (`[producer] spool_dir`). Each producer process appends to a file of
//! its own, `spool-<pid>-<id>.log`, which it holds under an exclusive lock (`flock`) for as
//! long as it lives; several processes therefore share a directory without ever writing to
//! the same file. A record is one line: the FNV-1a 64 checksum of its JSON (16 hex digits), a
//! space, the JSON (a [`Spooled`]: the envelope as it would have been published, its key, id
//! and `enqueued_at` included), and a newline; `append` returns only after `fsync`.
//!
//! Flushing takes whole files: the process's own (it starts a new one for later appends) and
//! those whose owner is gone (their lock can be taken). Records are handed out in order; after
//! each confirmed stretch the flusher writes how many are done to a sidecar
//! (`<file>.done`), and the file goes when all are. A flusher killed in between republishes
//! at most the stretch it had not recorded, under the same keys (workers absorb the copies).
//!
//! A producer killed mid-write leaves a last line without its newline, or with a checksum that
//! does not match: that torn tail is copied aside to `<file>.torn` (reported with its line
//! number, never replayed), and every whole record before it is flushed. A damaged line
//! elsewhere is set aside the same way. The file itself is never rewritten: its lock stays
//! on the one inode.
//!
//! A spool belongs to one prefix: the records do not name theirs, so a directory shared by
//! two prefixes would publish one's jobs into the other's queues. The directory and its
//! `.prefix` file (the owner's prefix) are made at the first append; opening a directory whose
//! `.prefix` names another prefix is refused.

use chime_shared::envelope::Envelope;
use chrono::{DateTime, Utc};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// One spooled job: what is needed to publish it later exactly as it would have been now.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Spooled {
    /// The message body (key, id and `enqueued_at` as first made).
    pub envelope: Envelope,
    /// When it is to be delivered (a delayed job); `None`: at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deliver_at: Option<DateTime<Utc>>,
    /// A queue of a job defined in Rust that must be declared before the publish.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub declare_queue: Option<String>,
    /// When it was spooled.
    pub spooled_at: DateTime<Utc>,
    /// Why: the publish error that sent it here.
    pub reason: String,
}

/// Why the spool could not take or give back a job.
#[derive(Debug, thiserror::Error)]
pub enum SpoolError {
    /// Reading or writing the spool directory failed.
    #[error("spool {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What the OS said.
        source: io::Error,
    },
    /// Taking the job would grow the spool past `producer.spool_max_bytes`.
    #[error(
        "spool {dir} is full: {used} bytes spooled, {adding} more would pass producer.spool_max_bytes ({max}); the job was not taken"
    )]
    Full {
        /// The spool directory.
        dir: PathBuf,
        /// Bytes held now.
        used: u64,
        /// Bytes the job needs.
        adding: u64,
        /// The bound.
        max: u64,
    },
    /// The directory holds the spool of another prefix (its `.prefix` file says which).
    #[error(
        "spool {dir} holds the jobs of prefix {theirs:?}, not {ours:?}: give each prefix a spool_dir of its own"
    )]
    OtherPrefix {
        /// The spool directory.
        dir: PathBuf,
        /// The prefix its `.prefix` names.
        theirs: String,
        /// The prefix of this config.
        ours: String,
    },
    /// A record could not be written as JSON (it cannot happen for a valid envelope).
    #[error("spool record: {0}")]
    Encode(String),
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> SpoolError + '_ {
    move |source| SpoolError::Io { path: path.to_path_buf(), source }
}

/// What a spool directory holds (`chime spool status`).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct SpoolStatus {
    /// Spool files.
    pub files: usize,
    /// Records still to be published.
    pub records: usize,
    /// Bytes held (spool files, sidecars and set-aside tails).
    pub bytes: u64,
    /// When the oldest record still to be published was spooled.
    pub oldest: Option<DateTime<Utc>>,
    /// Files of torn tails and damaged lines set aside (never replayed).
    pub torn: Vec<PathBuf>,
}

/// A spool directory, as one process sees it.
pub struct Spool {
    dir: PathBuf,
    /// The prefix whose jobs it holds.
    prefix: String,
    max_bytes: u64,
    /// Size at which this process starts its next file (`FILE_BYTES`).
    file_bytes: u64,
    /// This process's file (locked), opened at the first append.
    own: Mutex<Option<(File, PathBuf)>>,
}

/// A spool file taken for flushing (its lock held until this is dropped).
pub struct Claimed {
    _file: File,
    path: PathBuf,
    /// Its complete records not yet published, in order.
    pub records: Vec<Spooled>,
    /// Records of the file already published before (from its sidecar).
    done_before: usize,
    /// The torn tail or damaged lines set aside while reading it, if any: where, and why.
    pub torn: Option<(PathBuf, String)>,
}

/// Bytes a spool file grows to before its producer starts the next one: a flush holds one
/// file's records in memory at a time, so a spool of any size is flushed in bounded memory.
const FILE_BYTES: u64 = 8 << 20;

const PREFIX: &str = "spool-";
/// The file naming the prefix whose spool a directory is.
const PREFIX_FILE: &str = ".prefix";
const LOG: &str = ".log";

/// FNV-1a, 64 bits: enough to tell a torn or damaged line from a whole one.
fn checksum(bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3))
}

/// One record as its line.
fn line(record: &Spooled) -> Result<Vec<u8>, SpoolError> {
    let json = serde_json::to_vec(record).map_err(|e| SpoolError::Encode(e.to_string()))?;
    let mut out = format!("{:016x} ", checksum(&json)).into_bytes();
    out.extend_from_slice(&json);
    out.push(b'\n');
    Ok(out)
}

/// A line's JSON, or why its checksum does not hold.
fn checked(line: &[u8]) -> Result<&[u8], String> {
    let (sum, json) = match (line.get(..16), line.get(16), line.get(17..)) {
        (Some(sum), Some(b' '), Some(json)) => (sum, json),
        _ => return Err("too short for a checksum and a record".into()),
    };
    let want = std::str::from_utf8(sum).ok().and_then(|s| u64::from_str_radix(s, 16).ok());
    if want != Some(checksum(json)) {
        return Err("checksum does not match".into());
    }
    Ok(json)
}

/// A line's record, or why it is not one.
fn parse(line: &[u8]) -> Result<Spooled, String> {
    serde_json::from_slice(checked(line)?).map_err(|e| format!("not a spooled job: {e}"))
}

/// When a record was spooled, read without building the record (its envelope is skipped).
#[derive(serde::Deserialize)]
struct SpooledAt {
    spooled_at: DateTime<Utc>,
}

impl Spool {
    /// The spool of `prefix` in `dir`, bounded by `max_bytes` in all. The directory is made at
    /// the first append (a missing one holds nothing); one that holds another prefix's spool
    /// is refused.
    pub fn open(dir: impl Into<PathBuf>, max_bytes: u64, prefix: &str) -> Result<Self, SpoolError> {
        let spool = Self {
            dir: dir.into(),
            prefix: prefix.to_string(),
            max_bytes,
            file_bytes: FILE_BYTES,
            own: Mutex::new(None),
        };
        spool.check_prefix()?;
        Ok(spool)
    }

    /// `Err` when the directory's `.prefix` names another prefix.
    fn check_prefix(&self) -> Result<(), SpoolError> {
        let path = self.dir.join(PREFIX_FILE);
        match fs::read_to_string(&path) {
            Ok(theirs) if theirs.trim_end() != self.prefix => Err(SpoolError::OtherPrefix {
                dir: self.dir.clone(),
                theirs: theirs.trim_end().to_string(),
                ours: self.prefix.clone(),
            }),
            Ok(_) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(SpoolError::Io { path, source: e }),
        }
    }

    /// Makes the directory and its `.prefix` (durably) unless they are there.
    fn make_dir(&self) -> Result<(), SpoolError> {
        fs::create_dir_all(&self.dir).map_err(io_err(&self.dir))?;
        let path = self.dir.join(PREFIX_FILE);
        match OpenOptions::new().write(true).create_new(true).open(&path) {
            Ok(mut f) => {
                f.write_all(format!("{}\n", self.prefix).as_bytes())
                    .and_then(|()| f.sync_all())
                    .map_err(io_err(&path))?;
                File::open(&self.dir).and_then(|d| d.sync_all()).map_err(io_err(&self.dir))
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => self.check_prefix(),
            Err(e) => Err(SpoolError::Io { path, source: e }),
        }
    }

    /// The directory's entries; none when it does not exist yet.
    fn entries(&self) -> Result<Vec<fs::DirEntry>, SpoolError> {
        match fs::read_dir(&self.dir) {
            Ok(rd) => rd.collect::<Result<Vec<_>, _>>().map_err(io_err(&self.dir)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(SpoolError::Io { path: self.dir.clone(), source: e }),
        }
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether this process has a file of records no flush has taken yet.
    pub fn holds_own(&self) -> bool {
        self.own.lock().unwrap_or_else(std::sync::PoisonError::into_inner).is_some()
    }

    /// Bytes every file of the directory holds.
    fn used(&self) -> Result<u64, SpoolError> {
        let mut used = 0;
        for entry in self.entries()? {
            if entry.file_name().to_string_lossy().starts_with(PREFIX) {
                match entry.metadata() {
                    Ok(meta) => used += meta.len(),
                    // Gone meanwhile: a flusher finished a file, or renamed its sidecar.
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(e) => return Err(SpoolError::Io { path: entry.path(), source: e }),
                }
            }
        }
        Ok(used)
    }

    /// Appends `records` in order and makes them durable (`fsync`) before returning; all or
    /// nothing against the bound: a spool that cannot take them all takes none.
    pub fn append(&self, records: &[Spooled]) -> Result<(), SpoolError> {
        let mut bytes = Vec::new();
        for r in records {
            bytes.extend(line(r)?);
        }
        let used = self.used()?;
        let adding = bytes.len() as u64;
        if used.saturating_add(adding) > self.max_bytes {
            return Err(SpoolError::Full { dir: self.dir.clone(), used, adding, max: self.max_bytes });
        }
        let mut own = self.own.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((file, _)) = own.as_ref()
            && let Ok(meta) = file.metadata()
            && meta.len() > 0
            && meta.len().saturating_add(adding) > self.file_bytes
        {
            *own = None; // full: left (unlocked) for a flusher, and a new one started
        }
        let (file, path) = match own.as_mut() {
            Some(open) => open,
            None => own.insert(self.create()?),
        };
        let written = file.write_all(&bytes).and_then(|()| file.sync_data());
        if let Err(e) = written {
            // A partial line may be on disk: leave this file (its tail is set aside when it is
            // flushed) and start a new one next time.
            let path = path.clone();
            *own = None;
            return Err(SpoolError::Io { path, source: e });
        }
        Ok(())
    }

    /// A new file of this process's, locked.
    fn create(&self) -> Result<(File, PathBuf), SpoolError> {
        self.make_dir()?;
        // Named by creation time first, so that names sort in the order jobs were spooled.
        let nanos = Utc::now().timestamp_nanos_opt().unwrap_or(0);
        let name =
            format!("{PREFIX}{nanos:020}-{}-{}{LOG}", std::process::id(), uuid::Uuid::new_v4().simple());
        let path = self.dir.join(name);
        let file = OpenOptions::new().create_new(true).append(true).open(&path).map_err(io_err(&path))?;
        file.try_lock()
            .map_err(|e| SpoolError::Io { path: path.clone(), source: io::Error::other(e.to_string()) })?;
        // The new name must survive a crash too.
        File::open(&self.dir).and_then(|d| d.sync_all()).map_err(io_err(&self.dir))?;
        Ok((file, path))
    }

    /// Spool files in the order they were created (their names begin with the time).
    fn files(&self) -> Result<Vec<PathBuf>, SpoolError> {
        let mut files = Vec::new();
        for entry in self.entries()? {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(PREFIX) && name.ends_with(LOG) {
                files.push(entry.path());
            }
        }
        files.sort();
        Ok(files)
    }

    /// The oldest file that can be flushed now, taken: this process's own (later appends go
    /// to a new one) or one no live process holds; `None` when there is none. Files another
    /// process (or a [`Claimed`] still held) holds are left. Call again for the next.
    pub fn claim_next(&self) -> Result<Option<Claimed>, SpoolError> {
        for path in self.files()? {
            let mine = {
                let mut own = self.own.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                own.take_if(|(_, p)| *p == path)
            };
            if let Some((file, path)) = mine {
                return Claimed::read(file, path).map(Some);
            }
            let file = match OpenOptions::new().read(true).append(true).open(&path) {
                Ok(f) => f,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue, // flushed meanwhile
                Err(e) => return Err(SpoolError::Io { path, source: e }),
            };
            if file.try_lock().is_err() {
                continue; // a live producer's, or another flusher's
            }
            if !path.exists() {
                continue; // finished by a flusher between our open and our lock
            }
            return Claimed::read(file, path).map(Some);
        }
        Ok(None)
    }

    /// Every file that can be flushed now, taken, oldest first (see [`Spool::claim_next`]).
    pub fn claim(&self) -> Result<Vec<Claimed>, SpoolError> {
        let mut out = Vec::new();
        while let Some(c) = self.claim_next()? {
            out.push(c);
        }
        Ok(out)
    }

    /// What the directory holds, read without taking anything (records of files other
    /// processes hold included; a torn tail there is not counted as a record).
    pub fn status(&self) -> Result<SpoolStatus, SpoolError> {
        let mut status = SpoolStatus { bytes: self.used()?, ..Default::default() };
        for entry in self.entries()? {
            let path = entry.path();
            if path.to_string_lossy().ends_with(TORN) {
                status.torn.push(path);
            }
        }
        status.torn.sort();
        // Counted line by line, one file in memory at a time: a producer holding a large spool
        // reports it often (its flusher, the alert), and must not hold it all to count it.
        let files = self.files()?;
        for path in &files {
            let Ok(bytes) = fs::read(path) else { continue }; // flushed meanwhile
            let records = bytes
                .split_inclusive(|b| *b == b'\n')
                .filter_map(|l| l.strip_suffix(b"\n"))
                .filter_map(|l| checked(l).ok())
                .filter_map(|json| serde_json::from_slice::<SpooledAt>(json).ok())
                .skip(read_done(path));
            for r in records {
                status.records += 1;
                status.oldest = Some(status.oldest.map_or(r.spooled_at, |o| o.min(r.spooled_at)));
            }
        }
        status.files = files.len();
        Ok(status)
    }

    /// Every record still to be published, in order (`chime spool list`), read without
    /// taking anything.
    pub fn list(&self) -> Result<Vec<Spooled>, SpoolError> {
        let mut out = Vec::new();
        for path in self.files()? {
            let Ok(bytes) = fs::read(&path) else { continue }; // flushed meanwhile
            out.extend(split(&bytes).0.into_iter().skip(read_done(&path)));
        }
        Ok(out)
    }
}

/// A line that is not a whole record: its number (1-based), why, and its bytes.
type BadLine<'a> = (usize, String, &'a [u8]);

/// A file's whole records in order, and its other lines.
fn split(bytes: &[u8]) -> (Vec<Spooled>, Vec<BadLine<'_>>) {
    let (mut good, mut bad) = (Vec::new(), Vec::new());
    for (i, l) in bytes.split_inclusive(|b| *b == b'\n').enumerate() {
        let parsed = match l.strip_suffix(b"\n") {
            Some(whole) => parse(whole),
            None => Err("no newline at its end (a write cut off)".into()),
        };
        match parsed {
            Ok(r) => good.push(r),
            Err(why) => bad.push((i + 1, why, l)),
        }
    }
    (good, bad)
}

const TORN: &str = ".torn";

/// The sidecar of `path`: how many of its records were published.
fn done_path(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".done");
    PathBuf::from(p)
}

fn read_done(path: &Path) -> usize {
    fs::read_to_string(done_path(path)).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0)
}

impl Claimed {
    /// Reads a locked file: its whole records after those its sidecar counts as published.
    /// A torn tail or damaged line is copied to `<file>.torn` (once) and never returned.
    fn read(file: File, path: PathBuf) -> Result<Self, SpoolError> {
        let bytes = fs::read(&path).map_err(io_err(&path))?;
        let done_before = read_done(&path);
        let (good, bad) = split(&bytes);
        let records = good.into_iter().skip(done_before).collect();
        let mut torn = None;
        if !bad.is_empty() {
            let mut aside = path.as_os_str().to_owned();
            aside.push(TORN);
            let aside = PathBuf::from(aside);
            let reason =
                bad.iter().map(|(n, why, _)| format!("line {n}: {why}")).collect::<Vec<_>>().join("; ");
            match OpenOptions::new().create_new(true).write(true).open(&aside) {
                Ok(mut f) => {
                    let mut copy = Vec::new();
                    for (_, _, l) in &bad {
                        copy.extend_from_slice(l);
                        if !l.ends_with(b"\n") {
                            copy.push(b'\n');
                        }
                    }
                    f.write_all(&copy).and_then(|()| f.sync_data()).map_err(io_err(&aside))?;
                    tracing::warn!(file = %path.display(), aside = %aside.display(), %reason,
                        "spool: lines that are not whole records set aside, not replayed");
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {} // set aside before
                Err(e) => return Err(SpoolError::Io { path: aside, source: e }),
            }
            torn = Some((aside, reason));
        }
        Ok(Self { _file: file, path, records, done_before, torn })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Records that the first `n` of [`Claimed::records`] are published (confirmed): a flush
    /// cut off after this does not publish them again.
    pub fn published(&self, n: usize) -> Result<(), SpoolError> {
        let sidecar = done_path(&self.path);
        let mut tmp = sidecar.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        fs::write(&tmp, format!("{}\n", self.done_before + n))
            .and_then(|()| File::open(&tmp)?.sync_all())
            .and_then(|()| fs::rename(&tmp, &sidecar))
            .map_err(io_err(&sidecar))
    }

    /// Every record is published: the file and its sidecar go.
    pub fn finish(self) -> Result<(), SpoolError> {
        fs::remove_file(&self.path).map_err(io_err(&self.path))?;
        match fs::remove_file(done_path(&self.path)) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                Err(SpoolError::Io { path: done_path(&self.path), source: e })
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests;
