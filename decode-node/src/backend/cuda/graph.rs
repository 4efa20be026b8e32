//! CUDA graphs of a step's pieces (#21 item 6), the device's half: capturing a piece queued
//! on the main stream, launching it, and the choice between the two that
//! [`crate::backend::graphs::GraphCache`] makes. Off unless `DECODE_NODE_GRAPHS=on`: not yet
//! run on a GPU; a start-up check that finds a replay disagreeing with the piece queued as it
//! is turns it off.

use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

use cudarc::driver::{CudaGraph, CudaSlice, CudaStream, DevicePtr, sys};

use super::BackendError;
use super::blas::Blas;
use super::driver::{Shared, dev_err};
use crate::backend::graphs::{Action, Buckets, GraphCache, GraphKey};

/// Graphs a device keeps: a model's layers times the buckets a node's batches pass through.
const CAPACITY: usize = 1024;

/// The graphs of one device, under the projections' lock.
pub(crate) struct StepGraphs {
    /// `Rc`: a graph is launched from the cache's lock holder only (the step thread).
    pub(crate) cache: GraphCache<Rc<CudaGraph>>,
    pub(crate) buckets: Buckets,
}

impl std::fmt::Debug for StepGraphs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepGraphs")
            .field("graphs", &self.cache.len())
            .field("stats", &self.cache.stats())
            .field("off", &self.cache.why_off())
            .field("buckets", &self.buckets)
            .finish()
    }
}

impl StepGraphs {
    /// On where `DECODE_NODE_GRAPHS` is `on`.
    pub(crate) fn from_env() -> Self {
        let on = std::env::var("DECODE_NODE_GRAPHS").is_ok_and(|v| v == "on");
        Self {
            cache: if on {
                GraphCache::new(CAPACITY)
            } else {
                GraphCache::off("DECODE_NODE_GRAPHS is not on")
            },
            buckets: Buckets::default(),
        }
    }

    /// Rows a step of `n` sequences runs its pieces over: its bucket where graphs are on,
    /// else `n` itself.
    pub(crate) fn rows(&self, n: usize) -> usize {
        if self.cache.why_off().is_some() {
            return n;
        }
        self.buckets.rows(n).unwrap_or(n)
    }
}

/// Queues what `queue` queues on `stream` into a graph instead, and instantiates it. Nothing
/// runs: the caller launches the graph. On an error the stream has left capture mode and
/// none of the piece is queued.
fn capture(
    stream: &Arc<CudaStream>,
    queue: impl FnOnce() -> Result<(), BackendError>,
) -> Result<CudaGraph, BackendError> {
    // Thread-local: a call of this thread that could not be captured (an allocation, a
    // blocking copy) fails the capture instead of running; other threads are unaffected.
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(|e| dev_err("beginning a graph capture", e))?;
    let queued = queue();
    // Always ended, even after a failed queue: the stream must leave capture mode.
    let ended = stream
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .map_err(|e| dev_err("ending a graph capture", e));
    queued?;
    ended?.ok_or_else(|| BackendError::Device("a graph capture ended with no graph".into()))
}

/// Runs the piece of `key` on the main stream: replays its graph, or captures it (then
/// launches the graph), or queues it as it is, as the cache says. `queue` queues the piece
/// over addresses fixed before the call and must not size a buffer or time a shape: inside a
/// capture those fail it (the piece is then queued as it is, and the key never captured
/// again).
pub(super) fn run_piece(
    g: &mut Blas,
    sh: &Shared,
    key: GraphKey,
    mut queue: impl FnMut(&mut Blas) -> Result<(), BackendError>,
) -> Result<(), BackendError> {
    let action = g.graphs.cache.action(&key);
    match action {
        Action::Queue => queue(g),
        Action::Replay(graph) => match graph.launch() {
            Ok(()) => Ok(()),
            Err(e) => match dev_err("launching a graph", e) {
                e @ BackendError::DeviceLost(_) => Err(e),
                e => {
                    // Nothing of it ran: queued as it is, and graphs are off from now on.
                    tracing::error!(error = %e, "a graph replay failed; graphs are off");
                    g.graphs.cache.turn_off(e.to_string());
                    queue(g)
                }
            },
        },
        Action::Capture => {
            g.ensure_workspace()?;
            g.capturing = true;
            let captured = capture(&sh.stream, || queue(g));
            g.capturing = false;
            match captured {
                Ok(graph) => {
                    let graph = Rc::new(graph);
                    let launched = graph
                        .launch()
                        .map_err(|e| dev_err("launching a graph just captured", e));
                    match launched {
                        Ok(()) => {
                            let (layer, rows) = (key.layer, key.rows);
                            g.graphs.cache.captured(key, graph);
                            if g.graphs.cache.stats().captures == 1 {
                                tracing::info!(
                                    layer,
                                    rows,
                                    "the first step piece captured as a CUDA graph; later steps replay it"
                                );
                            }
                            Ok(())
                        }
                        Err(e @ BackendError::DeviceLost(_)) => Err(e),
                        Err(e) => {
                            g.graphs.cache.capture_failed(key, &e.to_string());
                            queue(g)
                        }
                    }
                }
                Err(e @ BackendError::DeviceLost(_)) => Err(e),
                Err(e) => {
                    tracing::warn!(layer = key.layer, rows = key.rows, error = %e, "a graph capture failed; the piece is queued as it is");
                    g.graphs.cache.capture_failed(key, &e.to_string());
                    queue(g)
                }
            }
        }
    }
}

/// A layer constant kept on the device ([`LayerConsts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Const {
    /// The norm weight of the layer's `k`-th norm-and-project group counted from the last
    /// (0: the layer's own input norm).
    Norm(usize),
    /// The norm weight before the MLP.
    PostNorm,
    /// Biases and head norms of the layer's first half (and of the next layer's predicted
    /// query), packed as `qkv_finish` reads them.
    FirstHalf,
}

/// Layers' constants kept on the device (norm weights, biases), so that a piece of a layer
/// reads them at one address every step (a graph replays that address) instead of uploading
/// them each time.
#[derive(Default)]
pub(crate) struct LayerConsts {
    /// By layer and constant: what was uploaded, and where.
    held: HashMap<(usize, Const), (Vec<f32>, CudaSlice<f32>)>,
}

impl LayerConsts {
    /// The device address of `data`, constant `key`: uploaded where it is not held yet or
    /// differs from what is (another model's layer).
    pub(crate) fn get(
        &mut self,
        stream: &Arc<CudaStream>,
        key: (usize, Const),
        data: &[f32],
    ) -> Result<u64, BackendError> {
        let fresh = self.held.get(&key).is_none_or(|(h, _)| h != data);
        if fresh {
            let dev = stream
                .clone_htod(data)
                .map_err(|e| dev_err("a layer's constants", e))?;
            self.held.insert(key, (data.to_vec(), dev));
        }
        match self.held.get(&key) {
            Some((_, d)) => Ok(d.device_ptr(stream).0),
            None => Err(BackendError::Device("layer constants".into())),
        }
    }

    pub(crate) fn clear(&mut self) {
        self.held.clear();
    }
}
