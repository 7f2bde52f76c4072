//! Checkpoints: their versioned, checksummed wire format and their durable store in sled.
//!
//! This module owns everything about the local state directory: the record format, the key
//! scheme, the pending → committed life cycle, retention (savepoints are never pruned), and the
//! sequence of calls that makes a checkpoint durable. It never decides what was committed: sled
//! only records what this process saw, and the commit marker in Kafka stays the authority (see
//! `recovery`). sled 0.34 has had corruption reports after abrupt stops, so every record carries a
//! checksum and a corrupt record is reported and skipped rather than trusted.
//!
//! Key scheme: `ckpt/` followed by the checkpoint id as 20 zero-padded decimal digits (u64::MAX
//! has 20 digits). Fixed width makes byte order equal numeric order, so sled's ordered scans return
//! checkpoints by ascending id, and the key stays printable for operators and for `CorruptEntry`.
//!
//! Durability: every mutating call applies exactly one `sled::Batch` (so a checkpoint and the
//! pruning it causes land together or not at all), then calls `Db::flush`, then fsyncs any blob
//! files sled wrote, then `sync_all` on a handle to `<dir>/db` held open by the store. `flush`
//! alone ends in `sync_file_range` on Linux, which survives a process crash but not a power loss.
//! The one exception is the exactly-once commit, `commit_in_background`: its committed write and
//! that fsync run after the commit on a thread of its own, never on the checkpoint's path. The
//! commit marker, not sled, proves a commit, and recovery adopts its positions when sled lags.

use std::collections::{BTreeMap, HashSet};
use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::identity::Identity;
use crate::positions::Positions;

/// First bytes of every stored checkpoint, so that a foreign or garbled value is told apart from
/// a checkpoint of an unknown version.
pub const MAGIC: [u8; 4] = *b"EOSC";
/// The record format this build writes and the only one it reads.
pub const FORMAT_VERSION: u8 = 1;
/// Magic, version byte, big-endian crc32 of the payload.
pub const HEADER_LEN: usize = 4 + 1 + 4;

const KEY_PREFIX: &str = "ckpt/";
const KEY_ID_DIGITS: usize = 20;
/// The start positions a first run resolved from `source.start`, kept until the first committed
/// checkpoint replaces them: outside `KEY_PREFIX`, so never listed, pruned or taken for a commit.
const START_KEY: &str = "start/resolved";

/// sled's default cache is 1 GiB; a store holding a handful of small checkpoints needs almost
/// none, and the bridge runs in memory-limited containers.
const CACHE_CAPACITY_BYTES: u64 = 4 * 1024 * 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckpointState {
    Pending,
    Committed,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    pub id: u64,
    pub bridge_id: String,
    pub instance: u32,
    pub instances: u32,
    pub state: CheckpointState,
    pub positions: Positions,
    pub created_ms: i64,
    /// Set when this checkpoint is a named savepoint: retention never prunes it.
    pub savepoint: Option<String>,
    /// The clusters and topic incarnations the positions refer to. Added to format 1 as an
    /// optional field: records written before it decode with None, and builds that predate it
    /// ignore it, so neither an upgrade nor a downgrade has to rewrite the state directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<Identity>,
}

#[derive(Debug, Error)]
pub enum CodecError {
    #[error(
        "checkpoint record is {len} bytes, shorter than its {HEADER_LEN}-byte header: it was truncated"
    )]
    TooShort { len: usize },
    #[error(
        "not a checkpoint record: it starts with bytes {found:02x?}, expected the magic \"EOSC\""
    )]
    BadMagic { found: [u8; 4] },
    #[error(
        "checkpoint record has format version {found}, this build reads version {FORMAT_VERSION}: \
         upgrade eos-bridge to a release that reads it"
    )]
    UnsupportedVersion { found: u8 },
    #[error(
        "checkpoint record fails its checksum (stored crc32 {stored:08x}, computed {computed:08x}): \
         the stored bytes were damaged"
    )]
    ChecksumMismatch { stored: u32, computed: u32 },
    #[error("checkpoint record passed its checksum but its JSON payload is invalid: {0}")]
    Json(#[source] serde_json::Error),
}

pub fn encode(c: &Checkpoint) -> Vec<u8> {
    let payload = serde_json::to_vec(c).expect("a checkpoint always serializes to JSON");
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&MAGIC);
    out.push(FORMAT_VERSION);
    out.extend_from_slice(&crc32fast::hash(&payload).to_be_bytes());
    out.extend_from_slice(&payload);
    out
}

pub fn decode(bytes: &[u8]) -> Result<Checkpoint, CodecError> {
    if bytes.len() < HEADER_LEN {
        return Err(CodecError::TooShort { len: bytes.len() });
    }
    let found: [u8; 4] = bytes[0..4].try_into().expect("four bytes");
    if found != MAGIC {
        return Err(CodecError::BadMagic { found });
    }
    if bytes[4] != FORMAT_VERSION {
        return Err(CodecError::UnsupportedVersion { found: bytes[4] });
    }
    let stored = u32::from_be_bytes(bytes[5..9].try_into().expect("four bytes"));
    let payload = &bytes[HEADER_LEN..];
    let computed = crc32fast::hash(payload);
    if stored != computed {
        return Err(CodecError::ChecksumMismatch { stored, computed });
    }
    serde_json::from_slice(payload).map_err(CodecError::Json)
}

/// The sled key of a checkpoint id (see the module header for why this scheme).
pub fn checkpoint_key(id: u64) -> String {
    format!("{KEY_PREFIX}{id:0KEY_ID_DIGITS$}")
}

fn id_from_key(key: &str) -> Option<u64> {
    let digits = key.strip_prefix(KEY_PREFIX)?;
    // Only the canonical form: a key like "ckpt/7" was not written by this module, and accepting
    // it would let two keys name one id.
    if digits.len() != KEY_ID_DIGITS || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Loaded {
    /// The checkpoints that decode and pass their checksum, by ascending id.
    pub checkpoints: Vec<Checkpoint>,
    /// Entries that could not be used, for the operator to see; they are left in place.
    pub corrupt: Vec<CorruptEntry>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CorruptEntry {
    /// The printable sled key, accepted by `CheckpointStore::remove_key`.
    pub key: String,
    /// The id the key names, when the key itself is intact.
    pub id: Option<u64>,
    pub reason: String,
}

#[derive(Debug, Error)]
pub enum StoreError {
    #[error(
        "checkpoint retention is {retain}: at least 1 committed checkpoint must be kept to resume \
         from; set the retention to 1 or more"
    )]
    InvalidRetain { retain: usize },
    #[error(
        "cannot create the state directory {}: {source}; check the path and that this user may \
         write there", .dir.display()
    )]
    CreateDir { dir: PathBuf, source: io::Error },
    #[error(
        "the state directory {} is locked: another eos-bridge process is using it (one process per \
         state directory); stop that process, or give each instance a state directory of its own",
        .dir.display()
    )]
    Locked { dir: PathBuf },
    #[error(
        "cannot open the checkpoint database in {}: {source}; if the directory is damaged, move it \
         away and restart: recovery then adopts the positions of the newest commit marker",
        .dir.display()
    )]
    Open { dir: PathBuf, source: sled::Error },
    #[error(
        "the checkpoint database in {} failed: {source}; check the disk and its free space, then \
         restart", .dir.display()
    )]
    Db { dir: PathBuf, source: sled::Error },
    #[error("cannot {op} {}: {source}; check the disk and its free space", .path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("checkpoint {id} is not in {}: it was never written, or was pruned or discarded", .dir.display())]
    NotFound { dir: PathBuf, id: u64 },
    #[error(
        "checkpoint {id} in {} is already committed: a committed checkpoint is never overwritten \
         with a pending one nor discarded", .dir.display()
    )]
    AlreadyCommitted { dir: PathBuf, id: u64 },
    #[error(
        "checkpoint {id} in {} is still pending: its transaction may not have committed, so it \
         cannot be named or unnamed a savepoint; recovery settles it at the next start",
        .dir.display()
    )]
    NotCommitted { dir: PathBuf, id: u64 },
    #[error(
        "entry {key} in {} is corrupt ({reason}); remove the entry, or move the state directory \
         away and restart: the commit marker remains the authority on what was committed",
        .dir.display()
    )]
    Corrupt {
        dir: PathBuf,
        key: String,
        reason: String,
    },
    #[error(
        "entry {key} in {} holds a valid checkpoint: refusing to remove it as corrupt (discard \
         drops a pending checkpoint; retention prunes committed ones)", .dir.display()
    )]
    NotCorrupt { dir: PathBuf, key: String },
}

/// What fsyncing the blobs needs to remember, behind one lock that also serialises the
/// read-modify-write of every mutating call.
struct DurableFiles {
    /// Blob files already fsynced: sled never rewrites a blob in place, so each needs it once.
    synced_blobs: HashSet<OsString>,
}

pub struct CheckpointStore {
    dir: PathBuf,
    retain: usize,
    db: sled::Db,
    /// A handle on sled's log, `<dir>/db`, for its fsync; outside the lock, so that the
    /// background fsync does not hold up the next checkpoint's writes.
    db_file: File,
    durable: Mutex<DurableFiles>,
    background: Mutex<Background>,
}

/// The committed writes handed over after exactly-once commits, and the one thread that applies
/// and fsyncs them, under one lock: the thread decides to exit under it, so a checkpoint queued
/// meanwhile is never left behind.
#[derive(Default)]
struct Background {
    /// The writer thread, running or done and not yet joined.
    thread: Option<JoinHandle<Result<(), StoreError>>>,
    /// Committed checkpoints not yet handed to sled, oldest first.
    queued: Vec<Checkpoint>,
    /// The thread has not decided to exit yet: it looks at `queued` again before it does.
    running: bool,
}

/// Shows its directory only: the database's content is what `load` is for.
impl std::fmt::Debug for CheckpointStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckpointStore")
            .field("dir", &self.dir)
            .field("retain", &self.retain)
            .finish_non_exhaustive()
    }
}

impl CheckpointStore {
    /// Opens (creating if needed) the store in `dir`, keeping `retain` committed checkpoints that
    /// are not savepoints.
    pub fn open(dir: &Path, retain: usize) -> Result<Self, StoreError> {
        if retain == 0 {
            return Err(StoreError::InvalidRetain { retain });
        }
        let created = !dir.exists();
        fs::create_dir_all(dir).map_err(|source| StoreError::CreateDir {
            dir: dir.to_path_buf(),
            source,
        })?;
        let db = sled::Config::new()
            .path(dir)
            .cache_capacity(CACHE_CAPACITY_BYTES)
            .mode(sled::Mode::LowSpace)
            .open()
            .map_err(|source| open_error(dir, source))?;

        // sled 0.34 keeps its whole log in this one file; sled already holds the lock on it, and
        // flock locks belong to sled's descriptor, so this second handle neither takes nor drops it.
        let db_path = dir.join("db");
        let db_file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&db_path)
            .map_err(io_error("open", &db_path))?;

        // sled writes `conf` and creates `db` and `blobs/` without syncing them or their directory
        // entries: a power loss right after the first start could otherwise leave a directory
        // sled refuses to open. Doing it on every open also covers a previous run that crashed
        // before getting this far.
        let conf = dir.join("conf");
        if conf.exists() {
            sync_file(&conf)?;
        }
        db_file.sync_all().map_err(io_error("fsync", &db_path))?;
        sync_dir(&dir.join("blobs"))?;
        sync_dir(dir)?;
        if created {
            let parent = dir
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .unwrap_or(Path::new("."));
            sync_dir(parent)?;
        }

        let store = CheckpointStore {
            dir: dir.to_path_buf(),
            retain,
            db,
            db_file,
            durable: Mutex::new(DurableFiles {
                synced_blobs: HashSet::new(),
            }),
            background: Mutex::new(Background::default()),
        };
        // Blobs a previous process wrote may never have been synced.
        store.sync_new_blobs(&mut store.lock())?;
        Ok(store)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Every checkpoint entry: usable ones by ascending id, corrupt ones reported, not removed.
    pub fn load(&self) -> Result<Loaded, StoreError> {
        let mut loaded = Loaded::default();
        for entry in self.db.scan_prefix(KEY_PREFIX) {
            let (key, value) = entry.map_err(|e| self.db_error(e))?;
            match classify(&key, &value) {
                Ok(c) => loaded.checkpoints.push(c),
                Err(corrupt) => loaded.corrupt.push(corrupt),
            }
        }
        Ok(loaded)
    }

    /// The pre-commit write: `c` is stored as pending, whatever its `state` says, durably. Rewriting
    /// a pending checkpoint of the same id is allowed (an epoch retried after an abort keeps its id).
    ///
    /// Exactly-once writes one only for a checkpoint that names a savepoint: the operator is told
    /// about the savepoint after the commit, so its name must be on disk before the transaction
    /// commits, or a crash between the commit and the committed write would lose it. An ordinary
    /// checkpoint has no pending write: the commit marker proves its commit and recovery adopts
    /// the marker's positions when sled lacks it (docs/design.md, "The checkpoint protocol").
    pub fn write_pending(&self, c: &Checkpoint) -> Result<(), StoreError> {
        let mut files = self.lock_after_writer()?;
        match self.get(c.id) {
            Ok(Some(existing)) if existing.state == CheckpointState::Committed => {
                return Err(StoreError::AlreadyCommitted {
                    dir: self.dir.clone(),
                    id: c.id,
                });
            }
            // An unreadable entry holds nothing to protect; the new record replaces it.
            Ok(_) | Err(StoreError::Corrupt { .. }) => {}
            Err(e) => return Err(e),
        }
        let mut pending = c.clone();
        pending.state = CheckpointState::Pending;
        let mut batch = sled::Batch::default();
        batch.insert(checkpoint_key(pending.id).as_bytes(), encode(&pending));
        self.apply_durably(&mut files, batch)
    }

    /// Recovery's confirmation: the commit marker proves pending checkpoint `id` committed, so it
    /// is marked committed and pruned after, in one durable batch. Marking an already committed
    /// checkpoint again is harmless.
    pub fn mark_committed(&self, id: u64) -> Result<(), StoreError> {
        let mut files = self.lock_after_writer()?;
        let mut c = self.get(id)?.ok_or_else(|| StoreError::NotFound {
            dir: self.dir.clone(),
            id,
        })?;
        c.state = CheckpointState::Committed;
        self.commit_with_retention(&mut files, &c)
    }

    /// After an exactly-once `commit_transaction` succeeded: writes `c` as committed, prunes, and
    /// fsyncs, on a thread of its own, and returns at once. Nothing of it is on the checkpoint's
    /// path: beside a broker writing 1 KB records at 100 ms the fsync's p99 was 40-140 ms, and a
    /// write issued while the previous fsync ran stalled behind it (bench/README.md, sessions 12
    /// and 13).
    ///
    /// One thread at a time: checkpoints committed while it works are queued and written together
    /// in its next round, with one fsync, so a slow disk makes the rounds larger, not more
    /// numerous, and sled lags the newest commit by at most two rounds. The marker proves the
    /// commits in that lag and recovery adopts its positions. A failed round is reported by the
    /// next call or by `wait_synced` (the writes it covered may not be on disk).
    pub fn commit_in_background(self: &Arc<Self>, c: &Checkpoint) -> Result<(), StoreError> {
        let mut committed = c.clone();
        committed.state = CheckpointState::Committed;
        let mut b = self.background_state();
        // A thread that ended while still running panicked: joining it reports that.
        let ended = b.thread.as_ref().is_none_or(JoinHandle::is_finished);
        if b.running && !ended {
            b.queued.push(committed);
            return Ok(());
        }
        // Done, or about to return (it decided so under this lock): joining does not wait.
        if let Some(done) = b.thread.take() {
            self.joined(done)?;
        }
        b.queued.push(committed);
        let store = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name("eos-bridge-store".into())
            .spawn(move || store.write_queued());
        match spawned {
            Ok(handle) => {
                b.thread = Some(handle);
                b.running = true;
                Ok(())
            }
            // Without a thread the write happens here: the same durability, on the data path.
            Err(e) => {
                drop(b);
                tracing::warn!(error = %e, "could not start the checkpoint writer thread; writing in line");
                self.write_queued()
            }
        }
    }

    /// The writer thread's loop: every round writes what is queued in one batch and fsyncs it,
    /// until a look at the queue under the lock finds it empty.
    fn write_queued(&self) -> Result<(), StoreError> {
        loop {
            let round = {
                let mut b = self.background_state();
                if b.queued.is_empty() {
                    b.running = false;
                    return Ok(());
                }
                std::mem::take(&mut b.queued)
            };
            // The writers' lock covers the read-modify-write of the batch, not the fsync.
            let written = {
                let _files = self.lock();
                self.committed_batch(&round)
                    .and_then(|batch| self.db.apply_batch(batch).map_err(|e| self.db_error(e)))
            };
            if let Err(e) = written.and_then(|()| self.sync_now()) {
                self.background_state().running = false;
                return Err(e);
            }
        }
    }

    fn background_state(&self) -> MutexGuard<'_, Background> {
        // The queue and the handle are valid after any panic.
        self.background.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Makes every write so far durable (a graceful stop calls it after its final checkpoint).
    pub fn sync(&self) -> Result<(), StoreError> {
        self.wait_synced()?;
        self.sync_now()
    }

    fn sync_now(&self) -> Result<(), StoreError> {
        self.db.flush().map_err(|e| self.db_error(e))?;
        self.sync_new_blobs(&mut self.lock())?;
        self.sync_log()
    }

    fn sync_log(&self) -> Result<(), StoreError> {
        self.db_file
            .sync_all()
            .map_err(io_error("fsync", &self.dir.join("db")))
    }

    /// Waits until every checkpoint handed to `commit_in_background` is written and fsynced: its
    /// error, if a round failed, is the caller's. Every other write waits here first, so that
    /// sled sees the checkpoints in the order they committed, and recovery reads them all.
    pub fn wait_synced(&self) -> Result<(), StoreError> {
        let handle = self.background_state().thread.take();
        match handle {
            Some(handle) => self.joined(handle),
            None => Ok(()),
        }
    }

    fn joined(&self, handle: JoinHandle<Result<(), StoreError>>) -> Result<(), StoreError> {
        handle.join().unwrap_or_else(|_| {
            let db_path = self.dir.join("db");
            Err(io_error("fsync", &db_path)(io::Error::other(
                "the checkpoint writer thread panicked",
            )))
        })
    }

    /// Stores `c` directly as committed (at-least-once mode, an exactly-once checkpoint that names
    /// a savepoint, or a checkpoint adopted from a commit marker) and prunes, in one durable
    /// batch, after every checkpoint handed to `commit_in_background` is in.
    pub fn put_committed(&self, c: &Checkpoint) -> Result<(), StoreError> {
        let mut files = self.lock_after_writer()?;
        let mut committed = c.clone();
        committed.state = CheckpointState::Committed;
        self.commit_with_retention(&mut files, &committed)
    }

    /// Names committed checkpoint `id` a savepoint (retention never prunes it), or with `None`
    /// makes it an ordinary checkpoint again, which retention then treats like any other. A
    /// pending checkpoint is refused: marking it committed here would claim a commit nobody saw.
    pub fn set_savepoint(&self, id: u64, name: Option<String>) -> Result<(), StoreError> {
        let mut files = self.lock();
        let mut c = self.get(id)?.ok_or_else(|| StoreError::NotFound {
            dir: self.dir.clone(),
            id,
        })?;
        if c.state != CheckpointState::Committed {
            return Err(StoreError::NotCommitted {
                dir: self.dir.clone(),
                id,
            });
        }
        c.savepoint = name;
        self.commit_with_retention(&mut files, &c)
    }

    /// The start positions kept by `put_resolved_start`, if no committed checkpoint has replaced
    /// them yet. Stored in checkpoint form (id 0); an error if the entry is corrupt.
    pub fn resolved_start(&self) -> Result<Option<Checkpoint>, StoreError> {
        let Some(value) = self
            .db
            .get(START_KEY.as_bytes())
            .map_err(|e| self.db_error(e))?
        else {
            return Ok(None);
        };
        decode(&value).map(Some).map_err(|e| StoreError::Corrupt {
            dir: self.dir.clone(),
            key: START_KEY.to_string(),
            reason: e.to_string(),
        })
    }

    /// Keeps the start positions a first run resolved (`latest`, a timestamp) durably, so that a
    /// restart before the first commit starts from the same positions instead of resolving again
    /// and skipping what arrived meanwhile. The next committed checkpoint removes them.
    pub fn put_resolved_start(&self, c: &Checkpoint) -> Result<(), StoreError> {
        let mut files = self.lock();
        let mut batch = sled::Batch::default();
        batch.insert(START_KEY.as_bytes(), encode(c));
        self.apply_durably(&mut files, batch)
    }

    /// Drops a pending checkpoint that was never committed. A missing id is not an error, so a
    /// discard interrupted by a crash can simply be repeated.
    pub fn discard(&self, id: u64) -> Result<(), StoreError> {
        let mut files = self.lock_after_writer()?;
        match self.get(id)? {
            None => Ok(()),
            Some(c) if c.state == CheckpointState::Committed => Err(StoreError::AlreadyCommitted {
                dir: self.dir.clone(),
                id,
            }),
            Some(_) => {
                let mut batch = sled::Batch::default();
                batch.remove(checkpoint_key(id).as_bytes());
                self.apply_durably(&mut files, batch)
            }
        }
    }

    /// Drops a checkpoint whatever its state: only for the checkpoints of a layout this instance
    /// has taken over from, whose committed positions live on in that layout's commit markers.
    pub fn forget(&self, id: u64) -> Result<(), StoreError> {
        let mut files = self.lock();
        let mut batch = sled::Batch::default();
        batch.remove(checkpoint_key(id).as_bytes());
        self.apply_durably(&mut files, batch)
    }

    /// Drops an entry that `load` reported as corrupt. Refuses a key holding a usable checkpoint,
    /// so that this escape hatch cannot remove committed state by mistake.
    pub fn remove_key(&self, key: &str) -> Result<(), StoreError> {
        let mut files = self.lock();
        let Some(value) = self.db.get(key.as_bytes()).map_err(|e| self.db_error(e))? else {
            return Ok(());
        };
        if classify(key.as_bytes(), &value).is_ok() {
            return Err(StoreError::NotCorrupt {
                dir: self.dir.clone(),
                key: key.to_string(),
            });
        }
        let mut batch = sled::Batch::default();
        batch.remove(key.as_bytes());
        self.apply_durably(&mut files, batch)
    }

    /// Flips one byte of the newest checkpoint's stored value (durably) and returns its id: lets
    /// tests simulate the corruption sled has been reported to suffer after abrupt stops.
    #[cfg(any(test, feature = "failpoints"))]
    pub fn corrupt_newest_for_tests(&self) -> Result<Option<u64>, StoreError> {
        let mut files = self.lock();
        let Some(newest) = self.db.scan_prefix(KEY_PREFIX).next_back() else {
            return Ok(None);
        };
        let (key, value) = newest.map_err(|e| self.db_error(e))?;
        let mut bytes = value.to_vec();
        // The last byte is in the payload, so the checksum is what catches it.
        match bytes.last_mut() {
            Some(b) => *b ^= 0x5a,
            None => bytes.push(0x5a),
        }
        let mut batch = sled::Batch::default();
        batch.insert(key.clone(), bytes);
        self.apply_durably(&mut files, batch)?;
        Ok(std::str::from_utf8(&key).ok().and_then(id_from_key))
    }

    /// The writers' lock for a write outside the writer thread: taken once every checkpoint handed
    /// to `commit_in_background` is in, so that sled sees writes in commit order. Only for the
    /// pipeline's own thread (and offline commands): `wait_synced` collects the writer thread.
    fn lock_after_writer(&self) -> Result<MutexGuard<'_, DurableFiles>, StoreError> {
        self.wait_synced()?;
        Ok(self.lock())
    }

    fn lock(&self) -> MutexGuard<'_, DurableFiles> {
        // The guarded state is a file handle and a set of names, both valid after any panic.
        self.durable.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The checkpoint with `id`, `None` if absent, an error if its entry is corrupt.
    fn get(&self, id: u64) -> Result<Option<Checkpoint>, StoreError> {
        let key = checkpoint_key(id);
        let Some(value) = self.db.get(key.as_bytes()).map_err(|e| self.db_error(e))? else {
            return Ok(None);
        };
        classify(key.as_bytes(), &value)
            .map(Some)
            .map_err(|corrupt| StoreError::Corrupt {
                dir: self.dir.clone(),
                key: corrupt.key,
                reason: corrupt.reason,
            })
    }

    /// Writes committed checkpoint `c` and, in the same batch, applies retention as it will stand
    /// once `c` is in: a crash can never leave the new checkpoint without its pruning or the
    /// pruning without the new checkpoint.
    fn commit_with_retention(
        &self,
        files: &mut DurableFiles,
        c: &Checkpoint,
    ) -> Result<(), StoreError> {
        let batch = self.committed_batch(std::slice::from_ref(c))?;
        self.apply_durably(files, batch)
    }

    /// The batch that writes committed checkpoints `cs` with the retention that follows from them.
    fn committed_batch(&self, cs: &[Checkpoint]) -> Result<sled::Batch, StoreError> {
        let mut after: BTreeMap<u64, (CheckpointState, bool)> = BTreeMap::new();
        for entry in self.load()?.checkpoints {
            after.insert(entry.id, (entry.state, entry.savepoint.is_some()));
        }
        let mut batch = sled::Batch::default();
        for c in cs {
            after.insert(c.id, (c.state, c.savepoint.is_some()));
            batch.insert(checkpoint_key(c.id).as_bytes(), encode(c));
            // A committed checkpoint supersedes the resolved start positions for good.
            if c.state == CheckpointState::Committed {
                batch.remove(START_KEY.as_bytes());
            }
        }
        for id in prune(&after, self.retain) {
            batch.remove(checkpoint_key(id).as_bytes());
        }
        Ok(batch)
    }

    fn apply_durably(
        &self,
        files: &mut DurableFiles,
        batch: sled::Batch,
    ) -> Result<(), StoreError> {
        self.db.apply_batch(batch).map_err(|e| self.db_error(e))?;
        self.db.flush().map_err(|e| self.db_error(e))?;
        // Blobs before the log: the log points at them, so they must be on disk no later.
        self.sync_new_blobs(files)?;
        self.sync_log()
    }

    /// sled writes values above about 128 KiB (a node holding several checkpoints of thousands of
    /// partitions) as separate files under `blobs/` and never fsyncs them; the log would then
    /// survive a power loss that the blob it points at did not.
    fn sync_new_blobs(&self, files: &mut DurableFiles) -> Result<(), StoreError> {
        let blobs = self.dir.join("blobs");
        let entries = match fs::read_dir(&blobs) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(io_error("list", &blobs)(e)),
        };
        let mut present = HashSet::new();
        let mut synced_any = false;
        for entry in entries {
            let entry = entry.map_err(io_error("list", &blobs))?;
            let name = entry.file_name();
            if !files.synced_blobs.contains(&name) {
                match sync_file(&entry.path()) {
                    Ok(()) => synced_any = true,
                    // sled garbage-collects blobs concurrently.
                    Err(StoreError::Io { source, .. })
                        if source.kind() == io::ErrorKind::NotFound =>
                    {
                        continue
                    }
                    Err(e) => return Err(e),
                }
            }
            present.insert(name);
        }
        if synced_any {
            sync_dir(&blobs)?;
        }
        files.synced_blobs = present;
        Ok(())
    }

    fn db_error(&self, source: sled::Error) -> StoreError {
        StoreError::Db {
            dir: self.dir.clone(),
            source,
        }
    }
}

/// Ids to delete so that the store keeps the newest `retain` committed non-savepoint checkpoints
/// and no pending checkpoint older than the newest committed one (its epoch has been settled
/// since). Savepoints are never returned.
fn prune(entries: &BTreeMap<u64, (CheckpointState, bool)>, retain: usize) -> Vec<u64> {
    let newest_committed = entries
        .iter()
        .rev()
        .find(|(_, (state, _))| *state == CheckpointState::Committed)
        .map(|(id, _)| *id);
    let mut kept = 0;
    let mut delete = Vec::new();
    for (&id, &(state, savepoint)) in entries.iter().rev() {
        if savepoint {
            continue;
        }
        match state {
            CheckpointState::Committed if kept < retain => kept += 1,
            CheckpointState::Committed => delete.push(id),
            CheckpointState::Pending => {
                if newest_committed.is_some_and(|newest| id < newest) {
                    delete.push(id);
                }
            }
        }
    }
    delete
}

/// A stored entry as a usable checkpoint, or the reason it is not one.
fn classify(key: &[u8], value: &[u8]) -> Result<Checkpoint, CorruptEntry> {
    let printable = String::from_utf8_lossy(key).into_owned();
    let id = std::str::from_utf8(key).ok().and_then(id_from_key);
    let corrupt = |reason: String| CorruptEntry {
        key: printable.clone(),
        id,
        reason,
    };
    let Some(key_id) = id else {
        return Err(corrupt(format!(
            "the key is not `{KEY_PREFIX}` followed by a {KEY_ID_DIGITS}-digit id"
        )));
    };
    let c = decode(value).map_err(|e| corrupt(e.to_string()))?;
    if c.id != key_id {
        return Err(corrupt(format!(
            "the key names checkpoint {key_id} but the record holds checkpoint {}",
            c.id
        )));
    }
    Ok(c)
}

fn open_error(dir: &Path, source: sled::Error) -> StoreError {
    // sled reports a held lock only as an `Io` error of kind `Other` whose text says so.
    if let sled::Error::Io(e) = &source {
        let text = e.to_string();
        if e.kind() == io::ErrorKind::WouldBlock || text.contains("could not acquire lock") {
            return StoreError::Locked {
                dir: dir.to_path_buf(),
            };
        }
    }
    StoreError::Open {
        dir: dir.to_path_buf(),
        source,
    }
}

fn io_error(op: &'static str, path: &Path) -> impl FnOnce(io::Error) -> StoreError {
    let path = path.to_path_buf();
    move |source| StoreError::Io { op, path, source }
}

fn sync_file(path: &Path) -> Result<(), StoreError> {
    let f = File::open(path).map_err(io_error("open", path))?;
    f.sync_all().map_err(io_error("fsync", path))
}

/// A file's directory entry is durable only once its directory is fsynced.
fn sync_dir(path: &Path) -> Result<(), StoreError> {
    #[cfg(unix)]
    {
        sync_file(path)
    }
    // Other systems cannot open a directory as a file; the bridge ships for Linux.
    #[cfg(not(unix))]
    {
        let _ = path;
        Ok(())
    }
}

/// Opens a store that this process held a moment ago. sled releases its directory lock when its
/// background threads let go of the dropped database, a moment after the drop on a busy machine:
/// poll for it, within a bound, and fail on any other error at once.
#[cfg(test)]
fn reopen(path: &Path, retain: usize) -> CheckpointStore {
    let end = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match CheckpointStore::open(path, retain) {
            Ok(s) => return s,
            Err(StoreError::Locked { .. }) if std::time::Instant::now() < end => {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err(e) => panic!("reopening {path:?}: {e}"),
        }
    }
}

#[cfg(test)]
mod savepoint_tests {
    use super::*;
    use crate::positions::Positions;

    fn committed(id: u64) -> Checkpoint {
        Checkpoint {
            id,
            bridge_id: "b".into(),
            instance: 0,
            instances: 1,
            state: CheckpointState::Committed,
            positions: Positions::new(),
            created_ms: id as i64,
            savepoint: None,
            identity: None,
        }
    }

    #[test]
    fn a_savepoint_outlives_retention_until_unnamed() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::open(dir.path(), 2).unwrap();
        store.put_committed(&committed(1)).unwrap();
        store
            .set_savepoint(1, Some("before-upgrade".into()))
            .unwrap();
        for id in 2..6 {
            store.put_committed(&committed(id)).unwrap();
        }
        let ids = || -> Vec<u64> {
            store
                .load()
                .unwrap()
                .checkpoints
                .iter()
                .map(|c| c.id)
                .collect()
        };
        assert_eq!(ids(), vec![1, 4, 5]);
        store.set_savepoint(1, None).unwrap();
        assert_eq!(
            ids(),
            vec![4, 5],
            "an unnamed savepoint is pruned like any checkpoint"
        );
    }

    /// Committed checkpoints handed over after their commits are written by one thread at a
    /// time, in order, coalesced while it works; every other write waits for them first; and
    /// what they wrote is there after a reopen. A savepoint's pending write is in the file before
    /// the call returns.
    #[test]
    fn background_commits_land_in_order_before_any_other_write() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(CheckpointStore::open(dir.path(), 3).unwrap());
        store.put_committed(&committed(1)).unwrap();
        let on_disk = || fs::read(dir.path().join("db")).unwrap();

        for id in 2..=4 {
            store.commit_in_background(&committed(id)).unwrap();
        }
        {
            let b = store.background.lock().unwrap();
            assert!(
                b.thread.is_some() || b.queued.is_empty(),
                "never a queued checkpoint without a thread to write it"
            );
        }
        store.wait_synced().unwrap();
        {
            let b = store.background.lock().unwrap();
            assert!(
                b.thread.is_none() && !b.running && b.queued.is_empty(),
                "the wait leaves nothing running or queued"
            );
        }
        assert_eq!(
            states(&store),
            [
                (2, CheckpointState::Committed),
                (3, CheckpointState::Committed),
                (4, CheckpointState::Committed)
            ],
            "retention counts the background writes"
        );

        // An in-line write right behind a background one waits for it: sled sees commit order.
        store.commit_in_background(&committed(5)).unwrap();
        let mut named = committed(6);
        named.savepoint = Some("sp".into());
        let before = on_disk();
        store.write_pending(&named).unwrap();
        assert!(
            on_disk() != before,
            "a savepoint's pending write is in the file"
        );

        drop(store);
        assert_eq!(
            states(&reopen(dir.path(), 3)),
            [
                (3, CheckpointState::Committed),
                (4, CheckpointState::Committed),
                (5, CheckpointState::Committed),
                (6, CheckpointState::Pending)
            ]
        );
    }

    #[test]
    fn a_pending_checkpoint_is_never_named_or_unnamed() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::open(dir.path(), 2).unwrap();
        let mut pending = committed(7);
        pending.savepoint = Some("sp".into());
        store.write_pending(&pending).unwrap();
        for name in [None, Some("other".to_string())] {
            let err = store.set_savepoint(7, name).unwrap_err();
            assert!(
                matches!(err, StoreError::NotCommitted { id: 7, .. }),
                "{err}"
            );
        }
        let c = &store.load().unwrap().checkpoints[0];
        assert_eq!(
            (c.state, c.savepoint.as_deref()),
            (CheckpointState::Pending, Some("sp")),
            "still pending, still carrying its name"
        );
        store.discard(7).unwrap();
    }

    #[test]
    fn resolved_start_survives_reopen_until_the_first_commit() {
        let dir = tempfile::tempdir().unwrap();
        let mut start = committed(0);
        start.positions.set("t", 0, 42);
        {
            let store = CheckpointStore::open(dir.path(), 2).unwrap();
            assert_eq!(store.resolved_start().unwrap(), None);
            store.put_resolved_start(&start).unwrap();
            // A pending checkpoint proves no commit: the start positions stay.
            store.write_pending(&committed(1)).unwrap();
        }
        let store = reopen(dir.path(), 2);
        assert_eq!(store.resolved_start().unwrap(), Some(start));
        assert!(
            store.load().unwrap().checkpoints.iter().all(|c| c.id != 0),
            "the start positions are not a checkpoint"
        );
        store.mark_committed(1).unwrap();
        assert_eq!(store.resolved_start().unwrap(), None);
    }

    fn states(store: &CheckpointStore) -> Vec<(u64, CheckpointState)> {
        store
            .load()
            .unwrap()
            .checkpoints
            .iter()
            .map(|c| (c.id, c.state))
            .collect()
    }

    /// What a graceful stop does after its final checkpoint.
    #[test]
    fn sync_waits_for_the_background_commits_and_makes_them_durable() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = Arc::new(CheckpointStore::open(dir.path(), 5).unwrap());
            for id in [1, 2] {
                store.commit_in_background(&committed(id)).unwrap();
            }
            store.sync().unwrap();
        }
        assert_eq!(
            states(&reopen(dir.path(), 5)),
            [
                (1, CheckpointState::Committed),
                (2, CheckpointState::Committed)
            ]
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn checkpoint(id: u64, state: CheckpointState) -> Checkpoint {
        let mut positions = Positions::new();
        positions.set("orders", 0, id as i64 * 10);
        positions.set("orders", 3, 7);
        Checkpoint {
            id,
            bridge_id: "bridge".into(),
            instance: 1,
            instances: 3,
            state,
            positions,
            created_ms: 1_700_000_000_000 + id as i64,
            savepoint: None,
            identity: None,
        }
    }

    fn ids(store: &CheckpointStore) -> Vec<(u64, CheckpointState)> {
        let loaded = store.load().unwrap();
        assert!(loaded.corrupt.is_empty(), "{:?}", loaded.corrupt);
        loaded.checkpoints.iter().map(|c| (c.id, c.state)).collect()
    }

    use CheckpointState::{Committed, Pending};

    #[test]
    fn codec_round_trip() {
        let mut c = checkpoint(42, Pending);
        c.savepoint = Some("before-upgrade".into());
        let bytes = encode(&c);
        assert_eq!(&bytes[0..4], b"EOSC");
        assert_eq!(bytes[4], 1);
        assert_eq!(decode(&bytes).unwrap(), c);
        let json: serde_json::Value = serde_json::from_slice(&bytes[HEADER_LEN..]).unwrap();
        assert_eq!(json["state"], "pending");
    }

    #[test]
    fn identity_is_an_optional_field_of_format_1() {
        // A record written before identities were recorded still decodes, with none.
        let before = checkpoint(3, Committed);
        let bytes = encode(&before);
        assert!(!String::from_utf8_lossy(&bytes[HEADER_LEN..]).contains("identity"));
        assert_eq!(decode(&bytes).unwrap().identity, None);

        let mut with = checkpoint(4, Committed);
        with.identity = Some(Identity {
            source_cluster: Some("src-cluster".into()),
            sink_cluster: Some("sink-cluster".into()),
            source_topics: [("orders".to_string(), "kKMw2mZ0Qiea4k6b5_1QmA".to_string())]
                .into_iter()
                .collect(),
            sink_topics: Default::default(),
        });
        let bytes = encode(&with);
        assert_eq!(bytes[4], FORMAT_VERSION);
        assert_eq!(decode(&bytes).unwrap(), with);
    }

    #[test]
    fn each_corruption_kind_is_detected() {
        let good = encode(&checkpoint(1, Committed));

        let err = decode(&good[..HEADER_LEN - 1]).unwrap_err();
        assert!(matches!(err, CodecError::TooShort { len: 8 }), "{err}");

        let mut bad = good.clone();
        bad[0] = b'X';
        let err = decode(&bad).unwrap_err();
        assert!(matches!(err, CodecError::BadMagic { .. }), "{err}");
        assert!(err.to_string().contains("EOSC"), "{err}");

        let mut bad = good.clone();
        bad[4] = 2;
        let err = decode(&bad).unwrap_err();
        assert!(
            matches!(err, CodecError::UnsupportedVersion { found: 2 }),
            "{err}"
        );
        assert!(err.to_string().contains("upgrade"), "{err}");

        let mut bad = good.clone();
        let last = bad.len() - 1;
        bad[last] ^= 1;
        let err = decode(&bad).unwrap_err();
        assert!(matches!(err, CodecError::ChecksumMismatch { .. }), "{err}");

        // A payload with a valid checksum that is not a checkpoint.
        let payload = br#"{"id":"not a number"}"#;
        let mut bad = MAGIC.to_vec();
        bad.push(FORMAT_VERSION);
        bad.extend_from_slice(&crc32fast::hash(payload).to_be_bytes());
        bad.extend_from_slice(payload);
        let err = decode(&bad).unwrap_err();
        assert!(matches!(err, CodecError::Json(_)), "{err}");
    }

    #[test]
    fn keys_sort_by_id_and_are_printable() {
        assert_eq!(checkpoint_key(7), "ckpt/00000000000000000007");
        assert_eq!(checkpoint_key(u64::MAX), "ckpt/18446744073709551615");
        assert!(checkpoint_key(9) < checkpoint_key(10));
        assert_eq!(id_from_key(&checkpoint_key(u64::MAX)), Some(u64::MAX));
        assert_eq!(id_from_key("ckpt/7"), None);
        assert_eq!(id_from_key("ckpt/0000000000000000000x"), None);
    }

    #[test]
    fn pending_then_committed_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::open(dir.path(), 3).unwrap();
        assert_eq!(store.dir(), dir.path());
        assert!(
            dir.path().join("db").is_file(),
            "sled keeps its data in <dir>/db"
        );
        assert_eq!(store.load().unwrap(), Loaded::default());

        // The state passed in does not matter: the call decides it.
        store.write_pending(&checkpoint(1, Committed)).unwrap();
        assert_eq!(ids(&store), vec![(1, Pending)]);
        store.mark_committed(1).unwrap();
        let loaded = store.load().unwrap();
        assert_eq!(loaded.checkpoints, vec![checkpoint(1, Committed)]);

        // Idempotent.
        store.mark_committed(1).unwrap();
        assert_eq!(ids(&store), vec![(1, Committed)]);

        let err = store.mark_committed(2).unwrap_err();
        assert!(matches!(err, StoreError::NotFound { id: 2, .. }), "{err}");
        let err = store.write_pending(&checkpoint(1, Pending)).unwrap_err();
        assert!(
            matches!(err, StoreError::AlreadyCommitted { id: 1, .. }),
            "{err}"
        );

        store.put_committed(&checkpoint(2, Pending)).unwrap();
        assert_eq!(ids(&store), vec![(1, Committed), (2, Committed)]);
    }

    #[test]
    fn retention_keeps_exactly_retain_committed_and_every_savepoint() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::open(dir.path(), 2).unwrap();
        for id in 1..=6 {
            let mut c = checkpoint(id, Pending);
            if id == 2 {
                c.savepoint = Some("sp".into());
            }
            store.write_pending(&c).unwrap();
            store.mark_committed(id).unwrap();
        }
        assert_eq!(
            ids(&store),
            vec![(2, Committed), (5, Committed), (6, Committed)]
        );

        // put_committed prunes too, and stale pending checkpoints go with the next commit.
        store.write_pending(&checkpoint(7, Pending)).unwrap();
        store.write_pending(&checkpoint(9, Pending)).unwrap();
        store.put_committed(&checkpoint(8, Committed)).unwrap();
        assert_eq!(
            ids(&store),
            vec![(2, Committed), (6, Committed), (8, Committed), (9, Pending)]
        );
        let sp = store.load().unwrap().checkpoints[0].clone();
        assert_eq!(sp.savepoint.as_deref(), Some("sp"));
    }

    #[test]
    fn retention_of_zero_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let err = CheckpointStore::open(dir.path(), 0).err().unwrap();
        assert!(
            matches!(err, StoreError::InvalidRetain { retain: 0 }),
            "{err}"
        );
    }

    #[test]
    fn discard_drops_only_pending_checkpoints() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::open(dir.path(), 3).unwrap();
        store.put_committed(&checkpoint(1, Committed)).unwrap();
        store.write_pending(&checkpoint(2, Pending)).unwrap();
        store.discard(2).unwrap();
        assert_eq!(ids(&store), vec![(1, Committed)]);
        // Repeating a discard is harmless.
        store.discard(2).unwrap();
        let err = store.discard(1).unwrap_err();
        assert!(
            matches!(err, StoreError::AlreadyCommitted { id: 1, .. }),
            "{err}"
        );
        assert_eq!(ids(&store), vec![(1, Committed)]);
    }

    #[test]
    fn reopen_after_drop_sees_everything() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state").join("instance-1");
        {
            let store = CheckpointStore::open(&path, 5).unwrap();
            for id in 1..=3 {
                store.write_pending(&checkpoint(id, Pending)).unwrap();
                store.mark_committed(id).unwrap();
            }
            let mut sp = checkpoint(4, Committed);
            sp.savepoint = Some("keep".into());
            store.put_committed(&sp).unwrap();
            store.write_pending(&checkpoint(5, Pending)).unwrap();
        }
        let store = reopen(&path, 5);
        assert_eq!(
            ids(&store),
            vec![
                (1, Committed),
                (2, Committed),
                (3, Committed),
                (4, Committed),
                (5, Pending)
            ]
        );
        assert_eq!(
            store.load().unwrap().checkpoints[3].savepoint.as_deref(),
            Some("keep")
        );
    }

    #[test]
    fn second_open_of_a_locked_directory_fails_clearly() {
        let dir = tempfile::tempdir().unwrap();
        let _first = CheckpointStore::open(dir.path(), 3).unwrap();
        let err = CheckpointStore::open(dir.path(), 3).err().unwrap();
        assert!(matches!(err, StoreError::Locked { .. }), "{err:?}");
        let text = err.to_string();
        assert!(text.contains(&dir.path().display().to_string()), "{text}");
        assert!(text.contains("another eos-bridge process"), "{text}");
    }

    #[test]
    fn load_reports_a_corrupt_entry_and_returns_the_others() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_path_buf();
        {
            let store = CheckpointStore::open(&path, 5).unwrap();
            assert_eq!(store.corrupt_newest_for_tests().unwrap(), None);
            for id in 1..=3 {
                store.put_committed(&checkpoint(id, Committed)).unwrap();
            }
            assert_eq!(store.corrupt_newest_for_tests().unwrap(), Some(3));
        }
        // The damage is durable, and survives a reopen.
        let store = reopen(&path, 5);
        let loaded = store.load().unwrap();
        assert_eq!(
            loaded.checkpoints.iter().map(|c| c.id).collect::<Vec<_>>(),
            vec![1, 2]
        );
        assert_eq!(loaded.corrupt.len(), 1);
        let bad = &loaded.corrupt[0];
        assert_eq!(bad.key, "ckpt/00000000000000000003");
        assert_eq!(bad.id, Some(3));
        assert!(bad.reason.contains("checksum"), "{}", bad.reason);

        // Operations on the corrupt id say so; a valid key cannot be removed as corrupt.
        let err = store.mark_committed(3).unwrap_err();
        assert!(matches!(err, StoreError::Corrupt { .. }), "{err}");
        let err = store.remove_key(&checkpoint_key(2)).unwrap_err();
        assert!(matches!(err, StoreError::NotCorrupt { .. }), "{err}");

        store.remove_key(&bad.key).unwrap();
        assert_eq!(ids(&store), vec![(1, Committed), (2, Committed)]);
        store.remove_key(&bad.key).unwrap();
    }

    #[test]
    fn load_reports_foreign_keys_under_the_prefix() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::open(dir.path(), 3).unwrap();
        store.put_committed(&checkpoint(1, Committed)).unwrap();
        // A record stored under the wrong id, and a key this module never writes.
        store
            .db
            .insert(
                checkpoint_key(5).as_bytes(),
                encode(&checkpoint(6, Committed)),
            )
            .unwrap();
        store
            .db
            .insert("ckpt/7", encode(&checkpoint(7, Committed)))
            .unwrap();
        let loaded = store.load().unwrap();
        assert_eq!(loaded.checkpoints, vec![checkpoint(1, Committed)]);
        assert_eq!(loaded.corrupt.len(), 2);
        assert_eq!(loaded.corrupt[0].id, Some(5));
        assert!(loaded.corrupt[0].reason.contains("holds checkpoint 6"));
        assert_eq!(loaded.corrupt[1].key, "ckpt/7");
        assert_eq!(loaded.corrupt[1].id, None);
    }

    #[test]
    fn large_checkpoints_that_sled_stores_as_blobs_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let mut big = checkpoint(1, Committed);
        for p in 0..20_000 {
            big.positions
                .set("a-rather-long-topic-name", p, i64::MAX - p as i64);
        }
        {
            let store = CheckpointStore::open(dir.path(), 2).unwrap();
            store.put_committed(&big).unwrap();
        }
        assert!(
            fs::read_dir(dir.path().join("blobs")).unwrap().count() > 0,
            "expected sled to store this value as a blob"
        );
        let store = reopen(dir.path(), 2);
        assert_eq!(store.load().unwrap().checkpoints, vec![big]);
    }

    fn arb_identity() -> impl Strategy<Value = Identity> {
        let ids = || prop::collection::btree_map(any::<String>(), any::<String>(), 0..4);
        (
            any::<Option<String>>(),
            any::<Option<String>>(),
            ids(),
            ids(),
        )
            .prop_map(
                |(source_cluster, sink_cluster, source_topics, sink_topics)| Identity {
                    source_cluster,
                    sink_cluster,
                    source_topics,
                    sink_topics,
                },
            )
    }

    prop_compose! {
        fn arb_checkpoint()(
            id in any::<u64>(),
            bridge_id in any::<String>(),
            instance in any::<u32>(),
            instances in any::<u32>(),
            state in prop_oneof![Just(Pending), Just(Committed)],
            positions in prop::collection::vec((any::<String>(), any::<i32>(), any::<i64>()), 0..12)
                .prop_map(|v| v.into_iter().collect::<Positions>()),
            created_ms in any::<i64>(),
            savepoint in any::<Option<String>>(),
            identity in prop::option::of(arb_identity()),
        ) -> Checkpoint {
            Checkpoint {
                id,
                bridge_id,
                instance,
                instances,
                state,
                positions,
                created_ms,
                savepoint,
                identity,
            }
        }
    }

    proptest! {
        #[test]
        fn prop_round_trip(c in arb_checkpoint()) {
            prop_assert_eq!(decode(&encode(&c)).unwrap(), c);
        }

        #[test]
        fn prop_any_single_byte_flip_is_rejected(
            c in arb_checkpoint(),
            at in any::<prop::sample::Index>(),
            mask in 1u8..=255,
        ) {
            let mut bytes = encode(&c);
            let i = at.index(bytes.len());
            bytes[i] ^= mask;
            prop_assert!(decode(&bytes).is_err());
        }

        #[test]
        fn prop_any_truncation_is_rejected(c in arb_checkpoint(), at in any::<prop::sample::Index>()) {
            let bytes = encode(&c);
            let len = at.index(bytes.len());
            prop_assert!(decode(&bytes[..len]).is_err());
        }
    }
}
