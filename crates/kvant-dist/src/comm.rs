//! The communicator interface every backend implements, and the blocking
//! and typed conveniences built on it.
//!
//! Every collective is split in two, as DeepEP's "hook" split is: [`Comm::post`]
//! starts it and returns at once with a [`Request`] that owns the buffers;
//! [`Request::wait`] completes it and hands the result back. Between the
//! two the caller computes (the other micro-batch, the shared experts), and
//! calls [`Request::test`] to let the backend make progress: Open MPI moves
//! data only inside MPI calls (it has no progress thread), so a request
//! nobody tests between its post and its wait overlaps nothing but
//! latency. Blocking forms ([`CommExt`]) are post-then-wait.
//!
//! Collectives on one communicator must be posted in the same order on
//! every rank (MPI's rule). Two streams of work that post independently
//! (two micro-batches) each use their own communicator ([`Comm::split`]).

use crate::error::DistError;
use std::sync::Arc;
use std::time::Duration;

/// The element type of a [`Buffer`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    F32,
    U32,
    U8,
}

impl Elem {
    pub fn bytes(self) -> usize {
        match self {
            Elem::F32 | Elem::U32 => 4,
            Elem::U8 => 1,
        }
    }
}

/// What a collective moves: values of one element type, owned, so that a
/// posted request can keep them while the caller goes on.
#[derive(Clone, Debug, PartialEq)]
pub enum Buffer {
    F32(Vec<f32>),
    U32(Vec<u32>),
    U8(Vec<u8>),
}

impl Buffer {
    pub fn elem(&self) -> Elem {
        match self {
            Buffer::F32(_) => Elem::F32,
            Buffer::U32(_) => Elem::U32,
            Buffer::U8(_) => Elem::U8,
        }
    }

    /// Elements held.
    pub fn len(&self) -> usize {
        match self {
            Buffer::F32(v) => v.len(),
            Buffer::U32(v) => v.len(),
            Buffer::U8(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn byte_len(&self) -> usize {
        self.len() * self.elem().bytes()
    }

    /// An empty buffer of `elem` with room for `capacity` elements.
    pub fn with_capacity(elem: Elem, capacity: usize) -> Buffer {
        match elem {
            Elem::F32 => Buffer::F32(Vec::with_capacity(capacity)),
            Elem::U32 => Buffer::U32(Vec::with_capacity(capacity)),
            Elem::U8 => Buffer::U8(Vec::with_capacity(capacity)),
        }
    }

    /// `len` zeros of `elem`.
    pub fn zeros(elem: Elem, len: usize) -> Buffer {
        match elem {
            Elem::F32 => Buffer::F32(vec![0.0; len]),
            Elem::U32 => Buffer::U32(vec![0; len]),
            Elem::U8 => Buffer::U8(vec![0; len]),
        }
    }

    /// Appends elements `range` of `src` (the same element type).
    ///
    /// # Errors
    /// [`DistError::Mismatch`] when the types differ or the range is outside `src`.
    pub fn extend_from(
        &mut self,
        src: &Buffer,
        range: std::ops::Range<usize>,
    ) -> Result<(), DistError> {
        let bad = || DistError::Mismatch(format!("cannot append {range:?} of {src:?}"));
        match (self, src) {
            (Buffer::F32(d), Buffer::F32(s)) => {
                d.extend_from_slice(s.get(range.clone()).ok_or_else(bad)?)
            }
            (Buffer::U32(d), Buffer::U32(s)) => {
                d.extend_from_slice(s.get(range.clone()).ok_or_else(bad)?)
            }
            (Buffer::U8(d), Buffer::U8(s)) => {
                d.extend_from_slice(s.get(range.clone()).ok_or_else(bad)?)
            }
            _ => return Err(bad()),
        }
        Ok(())
    }

    /// The values, if they are f32.
    ///
    /// # Errors
    /// [`DistError::Mismatch`] for another element type.
    pub fn into_f32(self) -> Result<Vec<f32>, DistError> {
        match self {
            Buffer::F32(v) => Ok(v),
            other => Err(DistError::Mismatch(format!(
                "expected f32 values, got {:?}",
                other.elem()
            ))),
        }
    }

    /// Copies the values, which must be f32 and exactly `dst.len()` of
    /// them, into `dst` (a collective's result back into the caller's
    /// slice).
    ///
    /// # Errors
    /// [`DistError::Mismatch`] for another element type or length.
    pub fn copy_to_f32(self, dst: &mut [f32]) -> Result<(), DistError> {
        let src = self.into_f32()?;
        if dst.len() != src.len() {
            return Err(DistError::Mismatch(format!(
                "expected {} values back, got {}",
                dst.len(),
                src.len()
            )));
        }
        dst.copy_from_slice(&src);
        Ok(())
    }

    /// The values, if they are u32.
    ///
    /// # Errors
    /// [`DistError::Mismatch`] for another element type.
    pub fn into_u32(self) -> Result<Vec<u32>, DistError> {
        match self {
            Buffer::U32(v) => Ok(v),
            other => Err(DistError::Mismatch(format!(
                "expected u32 values, got {:?}",
                other.elem()
            ))),
        }
    }

    /// The values, if they are bytes.
    ///
    /// # Errors
    /// [`DistError::Mismatch`] for another element type.
    pub fn into_u8(self) -> Result<Vec<u8>, DistError> {
        match self {
            Buffer::U8(v) => Ok(v),
            other => Err(DistError::Mismatch(format!(
                "expected bytes, got {:?}",
                other.elem()
            ))),
        }
    }
}

/// How [`Collective::AllReduce`] and [`Collective::ReduceScatter`] combine
/// the ranks' values, element by element.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Max,
}

/// One collective operation with its input. Every rank of the
/// communicator posts the same variant with agreeing counts.
#[derive(Clone, Debug)]
pub enum Collective {
    /// Completes once every rank has posted it.
    Barrier,
    /// `buf` of rank `root` to every rank; the others pass a buffer of the
    /// same type and length, which the result replaces.
    Broadcast { buf: Buffer, root: usize },
    /// The element-wise reduction of every rank's `buf` (same type and
    /// length everywhere), on every rank. f32 sums are exact to the
    /// order of addition, which is the same on every rank, so every rank
    /// gets the same bits.
    AllReduce { buf: Buffer, op: ReduceOp },
    /// Every rank's `send` concatenated in rank order, on every rank;
    /// `counts[r]` elements come from rank `r` (so `send.len()` equals
    /// `counts[rank]`).
    AllGather { send: Buffer, counts: Vec<usize> },
    /// The element-wise reduction of every rank's `send` (`Σ counts`
    /// elements), of which rank `r` keeps the `counts[r]` elements at
    /// offset `Σ counts[..r]`.
    ReduceScatter {
        send: Buffer,
        counts: Vec<usize>,
        op: ReduceOp,
    },
    /// Personalised exchange: the first `send_counts[0]` elements of
    /// `send` go to rank 0, the next `send_counts[1]` to rank 1, and so
    /// on; the result is what every rank sent this one, in rank order, of
    /// `recv_counts[r]` elements from rank `r`. Both count lists have one
    /// entry per rank and agree between ranks (what `a` sends `b` is what
    /// `b` expects from `a`).
    AllToAllV {
        send: Buffer,
        send_counts: Vec<usize>,
        recv_counts: Vec<usize>,
    },
}

/// The kind of a collective, for statistics and cost models.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    Barrier,
    Broadcast,
    AllReduce,
    AllGather,
    ReduceScatter,
    AllToAllV,
}

impl Kind {
    pub const ALL: [Kind; 6] = [
        Kind::Barrier,
        Kind::Broadcast,
        Kind::AllReduce,
        Kind::AllGather,
        Kind::ReduceScatter,
        Kind::AllToAllV,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Barrier => "barrier",
            Kind::Broadcast => "broadcast",
            Kind::AllReduce => "all_reduce",
            Kind::AllGather => "all_gather",
            Kind::ReduceScatter => "reduce_scatter",
            Kind::AllToAllV => "all_to_all_v",
        }
    }
}

impl Collective {
    pub fn kind(&self) -> Kind {
        match self {
            Collective::Barrier => Kind::Barrier,
            Collective::Broadcast { .. } => Kind::Broadcast,
            Collective::AllReduce { .. } => Kind::AllReduce,
            Collective::AllGather { .. } => Kind::AllGather,
            Collective::ReduceScatter { .. } => Kind::ReduceScatter,
            Collective::AllToAllV { .. } => Kind::AllToAllV,
        }
    }

    /// The element type it moves (`None` for a barrier).
    pub fn elem(&self) -> Option<Elem> {
        match self {
            Collective::Barrier => None,
            Collective::Broadcast { buf, .. } | Collective::AllReduce { buf, .. } => {
                Some(buf.elem())
            }
            Collective::AllGather { send, .. }
            | Collective::ReduceScatter { send, .. }
            | Collective::AllToAllV { send, .. } => Some(send.elem()),
        }
    }

    /// Checks what this rank can check alone: count lists of one entry per
    /// rank, a buffer that matches them, a root that exists, a reduction
    /// the element type has. Mismatches between ranks are the backends'
    /// to detect where they can.
    ///
    /// # Errors
    /// [`DistError::Mismatch`] naming the problem.
    pub fn validate(&self, rank: usize, size: usize) -> Result<(), DistError> {
        let bad = |what: String| Err(DistError::Mismatch(what));
        let counts_ok = |name: &str, c: &[usize]| -> Result<(), DistError> {
            if c.len() != size {
                return bad(format!("{name} has {} entries for {size} ranks", c.len()));
            }
            Ok(())
        };
        match self {
            Collective::Barrier => Ok(()),
            Collective::Broadcast { root, .. } if *root >= size => {
                bad(format!("broadcast root {root} of {size} ranks"))
            }
            Collective::Broadcast { .. } => Ok(()),
            Collective::AllReduce { buf, op } | Collective::ReduceScatter { send: buf, op, .. }
                if buf.elem() == Elem::U8 && *op == ReduceOp::Sum =>
            {
                bad(format!("{op:?} of bytes"))
            }
            Collective::AllReduce { .. } => Ok(()),
            Collective::AllGather { send, counts } => {
                counts_ok("all-gather counts", counts)?;
                if send.len() != counts[rank] {
                    return bad(format!(
                        "all-gather: rank {rank} sends {} elements, counts say {}",
                        send.len(),
                        counts[rank]
                    ));
                }
                Ok(())
            }
            Collective::ReduceScatter { send, counts, .. } => {
                counts_ok("reduce-scatter counts", counts)?;
                let total: usize = counts.iter().sum();
                if send.len() != total {
                    return bad(format!(
                        "reduce-scatter: {} elements sent, counts add up to {total}",
                        send.len()
                    ));
                }
                Ok(())
            }
            Collective::AllToAllV {
                send,
                send_counts,
                recv_counts,
            } => {
                counts_ok("all-to-all send counts", send_counts)?;
                counts_ok("all-to-all receive counts", recv_counts)?;
                let total: usize = send_counts.iter().sum();
                if send.len() != total {
                    return bad(format!(
                        "all-to-all: {} elements sent, send counts add up to {total}",
                        send.len()
                    ));
                }
                Ok(())
            }
        }
    }

    /// Bytes this rank sends (`sent`) and receives (`received`) if the
    /// collective ran as a direct exchange: what cost models start from.
    pub fn bytes(&self, rank: usize, size: usize) -> (usize, usize) {
        let e = self.elem().map_or(0, Elem::bytes);
        let others = size.saturating_sub(1);
        match self {
            Collective::Barrier => (0, 0),
            Collective::Broadcast { buf, root } => match rank == *root {
                true => (buf.byte_len() * others, 0),
                false => (0, buf.byte_len()),
            },
            Collective::AllReduce { buf, .. } => (buf.byte_len(), buf.byte_len()),
            Collective::AllGather { send, counts } => {
                let total: usize = counts.iter().sum();
                (
                    send.byte_len() * others,
                    (total - counts.get(rank).copied().unwrap_or(0)) * e,
                )
            }
            Collective::ReduceScatter { send, counts, .. } => {
                let mine = counts.get(rank).copied().unwrap_or(0);
                (send.byte_len().saturating_sub(mine * e), mine * e * others)
            }
            Collective::AllToAllV {
                send_counts,
                recv_counts,
                ..
            } => {
                let off = |c: &[usize]| c.iter().sum::<usize>() - c.get(rank).copied().unwrap_or(0);
                (off(send_counts) * e, off(recv_counts) * e)
            }
        }
    }
}

/// A posted collective: owns its buffers until [`Request::wait`] returns
/// the result.
pub trait Request: Send {
    /// Lets the backend make progress; whether the collective is complete
    /// (then [`Request::wait`] returns at once). Never blocks.
    ///
    /// # Errors
    /// A [`DistError`] when the collective failed (a rank left or timed out).
    fn test(&mut self) -> Result<bool, DistError>;

    /// Completes the collective and returns its result (a barrier's is an
    /// empty byte buffer), waiting at most the communicator's timeout.
    ///
    /// # Errors
    /// [`DistError::Timeout`] when a rank does not join in time,
    /// [`DistError::RankLost`] when one is known to have gone.
    fn wait(self: Box<Self>) -> Result<Buffer, DistError>;
}

/// A group of ranks that run collectives together.
pub trait Comm: Send + Sync {
    /// This rank's index, `0..size()`.
    fn rank(&self) -> usize;

    /// Ranks in the group.
    fn size(&self) -> usize;

    /// Starts `op`; returns at once.
    ///
    /// # Errors
    /// [`DistError::Mismatch`] when `op` is malformed (see
    /// [`Collective::validate`]), or a backend error.
    fn post(&self, op: Collective) -> Result<Box<dyn Request>, DistError>;

    /// A new communicator of the ranks that pass the same `color`, ordered
    /// by `key` (then by rank). Collective: every rank calls it, in the
    /// same order relative to its other collectives on this communicator.
    ///
    /// # Errors
    /// A backend error.
    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Comm>, DistError>;

    /// How long a wait may last before the peer is declared lost.
    fn timeout(&self) -> Duration;

    /// Ends every rank of the job with `code` after an unrecoverable error
    /// (a lost peer): MPI aborts the whole job, the in-process backend
    /// fails every other rank's pending and future collectives. Returns
    /// only on backends that do not end the process.
    fn abort(&self, code: i32);
}

/// Blocking and typed forms of the collectives.
pub trait CommExt: Comm {
    /// Post, then wait.
    ///
    /// # Errors
    /// As [`Comm::post`] and [`Request::wait`].
    fn run(&self, op: Collective) -> Result<Buffer, DistError> {
        self.post(op)?.wait()
    }

    /// # Errors
    /// As [`CommExt::run`].
    fn barrier(&self) -> Result<(), DistError> {
        self.run(Collective::Barrier).map(drop)
    }

    /// Sums `x` over the ranks, in place.
    ///
    /// # Errors
    /// As [`CommExt::run`].
    fn all_reduce_sum(&self, x: &mut [f32]) -> Result<(), DistError> {
        if self.size() == 1 {
            return Ok(());
        }
        self.run(Collective::AllReduce {
            buf: Buffer::F32(x.to_vec()),
            op: ReduceOp::Sum,
        })?
        .copy_to_f32(x)
    }

    /// Every rank's `x` in rank order; `counts[r]` elements from rank `r`.
    ///
    /// # Errors
    /// As [`CommExt::run`].
    fn all_gather(&self, send: Buffer, counts: Vec<usize>) -> Result<Buffer, DistError> {
        self.run(Collective::AllGather { send, counts })
    }

    /// What every rank sent this one (see [`Collective::AllToAllV`]).
    ///
    /// # Errors
    /// As [`CommExt::run`].
    fn all_to_all_v(
        &self,
        send: Buffer,
        send_counts: Vec<usize>,
        recv_counts: Vec<usize>,
    ) -> Result<Buffer, DistError> {
        self.run(Collective::AllToAllV {
            send,
            send_counts,
            recv_counts,
        })
    }

    /// A variable-length message from `root` to every rank: its length
    /// first, then its words. Other ranks pass `None`.
    ///
    /// # Errors
    /// As [`CommExt::run`]; [`DistError::Mismatch`] when the root passes
    /// `None`.
    fn broadcast_words(&self, msg: Option<Vec<u32>>, root: usize) -> Result<Vec<u32>, DistError> {
        if self.size() == 1 {
            return msg.ok_or_else(|| DistError::Mismatch("the root broadcasts nothing".into()));
        }
        let is_root = self.rank() == root;
        if is_root && msg.is_none() {
            return Err(DistError::Mismatch("the root broadcasts nothing".into()));
        }
        let len = msg.as_ref().map_or(0, Vec::len);
        let len = u32::try_from(len)
            .map_err(|_| DistError::Mismatch(format!("a message of {len} words")))?;
        let len = self
            .run(Collective::Broadcast {
                buf: Buffer::U32(vec![len]),
                root,
            })?
            .into_u32()?;
        let len = len.first().copied().unwrap_or(0) as usize;
        let buf = match msg {
            Some(m) if is_root => m,
            _ => vec![0; len],
        };
        self.run(Collective::Broadcast {
            buf: Buffer::U32(buf),
            root,
        })?
        .into_u32()
    }
}

impl<C: Comm + ?Sized> CommExt for C {}
