//! Admission: which waiting request may start now, which waits, which is refused. Pure: the
//! step loop gathers the figures, this decides, and the tables below pin each rule.

use std::time::Duration;

use attention::BlockGeometry;

/// What one request can use at most.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Need {
    /// New tokens it may generate: `max_new_tokens` clamped to the context left (at least 1).
    pub max_new: u32,
    /// Device KV bytes: what it can ever attend (prompt, the token fed first and `max_new`
    /// more, in whole blocks), capped by the resident blocks a sparse mode keeps per head,
    /// plus the arena slots its key sketch takes where a device keeps one.
    pub device: u64,
    /// Host pool blocks its decode growth takes (one per layer for every block boundary its
    /// new tokens cross).
    pub grow_blocks: usize,
    /// Host pool blocks its key sketch takes where the host keeps one.
    pub sketch_pages: usize,
    /// Those blocks (growth and sketch) in bytes.
    pub host: u64,
    /// Bytes its prompt already holds in the pool.
    pub prompt_bytes: u64,
}

/// The request's figures that admission reads.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Request {
    /// Block geometry of the node's KV.
    pub geom: BlockGeometry,
    /// Layers.
    pub num_layers: usize,
    /// Tokens its KV holds.
    pub num_tokens: usize,
    /// Bytes its KV holds in the pool.
    pub prompt_bytes: u64,
    /// What the client asked for.
    pub max_new_tokens: u32,
}

/// Where each request's key sketch (`--block-scorer sketch`) is kept: on a device, in its
/// KV arena, a slot (a head block) per `tokens_per_slot` tokens of each (scored layer, KV
/// head); on the host, a pool block per `tokens_per_slot` tokens of each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SketchSlots {
    pub tokens_per_slot: usize,
    /// Layers that score blocks (past the dense ones).
    pub layers: usize,
    /// In device memory, or host pool blocks.
    pub on_device: bool,
}

impl SketchSlots {
    /// What a node attending with `attention` keeps of each request's sketch: on its device
    /// where that keeps and scores one (`device`), else in its host pool; `None` unless it
    /// scores blocks with the sketch.
    pub(crate) fn of_node(
        attention: &attention::AttentionConfig,
        geom: &BlockGeometry,
        num_layers: usize,
        device: bool,
    ) -> Option<Self> {
        let scores = attention.scorer == attention::BlockScorer::Sketch
            && attention.mode != attention::Mode::Full;
        let tokens_per_slot = if device {
            attention::sketch::tokens_per_slot(geom.head_bytes(), geom.head_dim)
        } else {
            attention::host_sketch::tokens_per_page(
                geom.block_bytes(),
                geom.head_dim,
                geom.block_size,
            )
        };
        (scores && tokens_per_slot > 0).then(|| Self {
            tokens_per_slot,
            layers: num_layers.saturating_sub(attention.dense_layers),
            on_device: device,
        })
    }

    /// Slots (or pages) of one KV head over the scored layers for `tokens` positions.
    pub(crate) fn per_head(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.tokens_per_slot.max(1)) * self.layers
    }

    /// Host pool blocks the sketch of `positions` takes over all `num_kv_heads` KV heads:
    /// none where the device keeps it.
    pub(crate) fn pool_pages(&self, positions: usize, num_kv_heads: usize) -> usize {
        if self.on_device {
            0
        } else {
            self.per_head(positions) * num_kv_heads
        }
    }
}

impl Need {
    /// What `r` can use on a node with `max_context` positions whose mode keeps at most
    /// `resident_per_head` blocks per (layer, KV head) on the device, and whose device keeps
    /// a key sketch per request where `sketch` says so.
    pub(crate) fn of(
        r: &Request,
        max_context: usize,
        resident_per_head: usize,
        sketch: Option<SketchSlots>,
    ) -> Self {
        let g = &r.geom;
        let room = max_context.saturating_sub(r.num_tokens + 1);
        let max_new = (r.max_new_tokens as usize).min(room.max(1));
        let positions = r.num_tokens + max_new + 1; // as `Need::positions`
        let can_attend = g.blocks_for(positions);
        let per_head = can_attend.min(resident_per_head);
        let (device_sketch, sketch_pages) = match sketch {
            Some(s) if s.on_device => (s.per_head(positions), 0),
            Some(s) => (0, s.pool_pages(positions, g.num_kv_heads)),
            None => (0, 0),
        };
        let device = (per_head * r.num_layers + device_sketch) as u64 * head_slot_bytes(r);
        let grow_blocks = (can_attend - g.blocks_for(r.num_tokens)) * r.num_layers;
        Self {
            max_new: max_new as u32,
            device,
            grow_blocks,
            sketch_pages,
            host: ((grow_blocks + sketch_pages) * g.block_bytes()) as u64,
            prompt_bytes: r.prompt_bytes,
        }
    }

    /// Positions `r` may ever hold: its prompt, the token fed first and `max_new` more.
    fn positions(&self, r: &Request) -> usize {
        r.num_tokens + self.max_new as usize + 1
    }
}

/// Bytes of one head block across a request's KV heads: a device slot per (layer, KV head)
/// costs this once per layer.
fn head_slot_bytes(r: &Request) -> u64 {
    (r.geom.head_bytes() * r.geom.num_kv_heads) as u64
}

impl Request {
    /// The device KV lending sees for it ([`super::lend`]): what [`Need::of`] counts, split
    /// into its sketch's bytes and its slots per (layer, KV head), with the slots that would
    /// hold every block it may ever have.
    pub(crate) fn share(
        &self,
        max_context: usize,
        resident_per_head: usize,
        sketch: Option<SketchSlots>,
    ) -> super::lend::Share {
        // No slots: what is left is the sketch.
        let fixed = Need::of(self, max_context, 0, sketch);
        let whole = self.geom.blocks_for(fixed.positions(self));
        super::lend::Share {
            fixed: fixed.device,
            per_block: head_slot_bytes(self) * self.num_layers as u64,
            base: whole.min(resident_per_head),
            whole,
            lent: 0,
        }
    }
}

/// The node at the moment of the decision.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Room {
    /// Requests decoding.
    pub running: usize,
    /// Most requests per step.
    pub max_batch: usize,
    /// Device KV bytes the running requests may hold.
    pub device_used: u64,
    /// Device KV bytes in all.
    pub device_capacity: u64,
    /// Host pool bytes in all.
    pub host_capacity: u64,
    /// A request ahead of this one still waits: first come, first served.
    pub queue_blocked: bool,
}

/// What to do with a waiting request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Reserve its host growth and start it (if the reservation fails, ask [`refusal`]).
    Start,
    /// Not now.
    Wait,
}

/// May `need` start in `room`? Batch room, device room and nobody ahead waiting.
pub(crate) fn decide(need: &Need, room: &Room) -> Decision {
    let fits_device = room.device_used + need.device <= room.device_capacity;
    if room.running < room.max_batch && fits_device && !room.queue_blocked {
        Decision::Start
    } else {
        Decision::Wait
    }
}

/// Why a request that could not start now is refused, if it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// More device or host KV than the node has: waiting cannot help.
    NeverFits,
    /// It waited past the queue timeout.
    TimedOut,
}

/// A request that did not start: refused, or `None` to keep waiting.
pub(crate) fn refusal(
    need: &Need,
    room: &Room,
    waited: Duration,
    timeout: Duration,
) -> Option<Refusal> {
    let host_room = room.host_capacity.saturating_sub(need.prompt_bytes);
    if need.device > room.device_capacity || need.host > host_room {
        Some(Refusal::NeverFits)
    } else if waited > timeout {
        Some(Refusal::TimedOut)
    } else {
        None
    }
}

impl Refusal {
    /// The RESOURCE_EXHAUSTED message for request `id`, naming the sizes.
    pub(crate) fn message(self, id: &str, need: &Need, room: &Room) -> String {
        format!(
            "request {:?} needs {} bytes of device KV (capacity {}) and {} more bytes of host KV for {} new tokens (host capacity {}, {} held by its prompt); {}",
            kv_transfer::clip(id),
            need.device,
            room.device_capacity,
            need.host,
            need.max_new,
            room.host_capacity,
            need.prompt_bytes,
            match self {
                Refusal::NeverFits => "it can never fit on this node",
                Refusal::TimedOut => "not available within the queue timeout",
            }
        )
    }
}

#[cfg(test)]
mod tests {
    use attention::KvDType;

    use super::*;

    /// 16-token blocks, 2 KV heads of 8 dims in f32: a head's block is 1 KiB, a block 2 KiB.
    const GEOM: BlockGeometry = BlockGeometry {
        block_size: 16,
        num_kv_heads: 2,
        head_dim: 8,
        dtype: KvDType::F32,
    };

    fn request(num_tokens: usize, max_new_tokens: u32) -> Request {
        Request {
            geom: GEOM,
            num_layers: 3,
            num_tokens,
            prompt_bytes: (GEOM.blocks_for(num_tokens) * 3 * GEOM.block_bytes()) as u64,
            max_new_tokens,
        }
    }

    #[test]
    fn a_requests_share_for_lending_counts_what_admission_counts() {
        let sketch = SketchSlots {
            tokens_per_slot: 8,
            layers: 2,
            on_device: true,
        };
        for (tokens, max_new, sketch) in [(20, 10, None), (20, 10, Some(sketch)), (300, 1, None)] {
            let r = request(tokens, max_new);
            let mut share = r.share(1000, 2, sketch);
            assert_eq!(share.base, 2);
            assert_eq!(
                share.base_bytes(),
                Need::of(&r, 1000, 2, sketch).device,
                "{tokens} {sketch:?}"
            );
            assert_eq!(share.whole, GEOM.blocks_for(tokens + max_new as usize + 1));
            share.lent = share.whole - share.base;
            assert_eq!(
                share.counted(),
                Need::of(&r, 1000, usize::MAX, sketch).device
            );
        }
        // A request shorter than the share: its base is every block.
        let share = request(5, 3).share(1000, 2, None);
        assert_eq!((share.base, share.whole), (1, 1));
    }

    #[test]
    fn a_device_sketch_adds_its_slots_to_the_device_need() {
        // 20 tokens + 1 fed + 10 new = 31 positions; 8 tokens a slot: 4 slots per (scored
        // layer, KV head), 2 layers of 3 scored.
        let plain = Need::of(&request(20, 10), 1000, usize::MAX, None);
        let sketch = SketchSlots {
            tokens_per_slot: 8,
            layers: 2,
            on_device: true,
        };
        let with = Need::of(&request(20, 10), 1000, usize::MAX, Some(sketch));
        assert_eq!(
            with.device - plain.device,
            (4 * 2 * 2 * GEOM.head_bytes()) as u64
        );
        assert_eq!((with.host, with.max_new), (plain.host, plain.max_new));
        assert_eq!(with.sketch_pages, 0);
    }

    #[test]
    fn a_host_sketch_adds_its_pages_to_the_host_need() {
        // As above, in pool blocks: 4 per (scored layer, KV head), 2 layers, 2 KV heads.
        let plain = Need::of(&request(20, 10), 1000, usize::MAX, None);
        let sketch = SketchSlots {
            tokens_per_slot: 8,
            layers: 2,
            on_device: false,
        };
        let with = Need::of(&request(20, 10), 1000, usize::MAX, Some(sketch));
        assert_eq!(with.sketch_pages, 4 * 2 * 2);
        assert_eq!(
            with.host - plain.host,
            (4 * 2 * 2 * GEOM.block_bytes()) as u64
        );
        assert_eq!(
            (with.device, with.grow_blocks),
            (plain.device, plain.grow_blocks)
        );
        // A node's own figures: f32 blocks of 16 tokens, 2 heads of 8 dims (2 KiB) hold
        // 2048 / (4 + 4) = 256 tokens, whole blocks.
        let cfg = attention::AttentionConfig {
            scorer: attention::BlockScorer::Sketch,
            dense_layers: 1,
            ..attention::AttentionConfig::scout(16)
        };
        let host = SketchSlots::of_node(&cfg, &GEOM, 3, false).unwrap();
        assert_eq!((host.tokens_per_slot, host.on_device), (256, false));
        assert_eq!(host.layers, 2);
        let full = attention::AttentionConfig {
            mode: attention::Mode::Full,
            ..cfg
        };
        assert_eq!(SketchSlots::of_node(&full, &GEOM, 3, false), None);
    }

    #[test]
    fn need_counts_what_a_request_can_use() {
        // (tokens, max_new, context, resident per head) -> (max_new, device blocks per head,
        // growth blocks in all)
        let table = [
            // 20 tokens + 1 fed + 10 new = 31 positions: the 2 blocks per head it has.
            ((20, 10, 1000, usize::MAX), (10, 2, 0)),
            // A budget larger than the request never reserves more than it can attend.
            ((20, 10, 1000, 1_000_000), (10, 2, 0)),
            // 20 + 1 + 20 = 41 positions: a third block per head, one more per layer.
            ((20, 20, 1000, usize::MAX), (20, 3, 3)),
            // A sparse mode's resident cap bounds the device need.
            ((200, 1000, 10_000, 4), (1000, 4, (76 - 13) * 3)),
            // max_new is clamped to the context left.
            ((90, 1000, 100, usize::MAX), (9, 7, 3)),
            // A full context still may generate one token.
            ((100, 5, 100, usize::MAX), (1, 7, 0)),
            // Exactly on a block boundary: the fed token opens a new block.
            ((32, 1, 1000, usize::MAX), (1, 3, 3)),
        ];
        for ((tokens, max_new, ctx, per_head), (want_new, want_dev, want_grow)) in table {
            let n = Need::of(&request(tokens, max_new), ctx, per_head, None);
            let case = format!("tokens {tokens} max_new {max_new} ctx {ctx} cap {per_head}");
            assert_eq!(n.max_new, want_new, "{case}");
            assert_eq!(
                n.device,
                (want_dev * GEOM.head_bytes() * 2 * 3) as u64,
                "{case}"
            );
            assert_eq!(n.grow_blocks, want_grow, "{case}");
            assert_eq!(n.host, (want_grow * GEOM.block_bytes()) as u64, "{case}");
        }
    }

    fn room(running: usize, device_used: u64, queue_blocked: bool) -> Room {
        Room {
            running,
            max_batch: 4,
            device_used,
            device_capacity: 100_000,
            host_capacity: 1 << 20,
            queue_blocked,
        }
    }

    #[test]
    fn a_request_starts_only_with_batch_and_device_room_and_nobody_ahead() {
        let need = Need::of(&request(20, 10), 1000, usize::MAX, None); // 12 KiB of device KV
        let table = [
            (room(0, 0, false), Decision::Start),
            (room(3, 0, false), Decision::Start),
            (room(4, 0, false), Decision::Wait),
            (room(0, 100_000 - need.device, false), Decision::Start),
            (room(0, 100_000 - need.device + 1, false), Decision::Wait),
            (room(0, 0, true), Decision::Wait),
        ];
        for (r, want) in table {
            assert_eq!(decide(&need, &r), want, "{r:?}");
        }
    }

    #[test]
    fn refused_when_it_can_never_fit_or_waited_too_long() {
        let t = Duration::from_secs(10);
        let (short, long) = (Duration::from_secs(1), Duration::from_secs(11));
        let small = Need::of(&request(20, 10), 1000, usize::MAX, None);
        let mut huge_device = small;
        huge_device.device = 100_001;
        let mut huge_host = small;
        huge_host.host = (1 << 20) - small.prompt_bytes + 1;
        let table = [
            (small, short, None),
            (small, long, Some(Refusal::TimedOut)),
            (huge_device, short, Some(Refusal::NeverFits)),
            (huge_host, short, Some(Refusal::NeverFits)),
            (huge_host, long, Some(Refusal::NeverFits)),
        ];
        for (need, waited, want) in table {
            assert_eq!(
                refusal(&need, &room(4, 0, true), waited, t),
                want,
                "{need:?}"
            );
        }
        let m = Refusal::NeverFits.message(&"x".repeat(1000), &huge_device, &room(0, 0, false));
        assert!(
            m.contains("100001 bytes of device KV (capacity 100000)"),
            "{m}"
        );
        assert!(m.contains("never fit") && m.len() < 400, "{m}");
    }
}
