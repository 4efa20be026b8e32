//! What the engine is given and what it gives back: a [`Job`] in, [`Event`]s out, [`Control`]
//! messages to steer it.

use std::time::Instant;

use kv_transfer::CommittedKv;
use tokio::sync::mpsc;

use super::EngineError;
use crate::model::Sampling;

/// Why a request finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_new_tokens` reached.
    Length,
    /// A stop id was generated.
    Stop,
    /// EOS was generated.
    Eos,
    /// Cancelled (Cancel, client gone, drain timeout).
    Cancelled,
    /// The model's context is full.
    ContextFull,
}

impl FinishReason {
    /// Label for `requests_total{outcome}`.
    pub fn label(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
            FinishReason::Eos => "eos",
            FinishReason::Cancelled => "cancelled",
            FinishReason::ContextFull => "context_full",
        }
    }
}

/// Per-request figures sent with the finish.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestStats {
    /// Seconds waiting for admission.
    pub queue_seconds: f64,
    /// Seconds from Generate arrival to the first token.
    pub first_token_seconds: f64,
    /// Seconds from Generate arrival to finish.
    pub total_seconds: f64,
    /// Share of selected tokens attended on the CPU.
    pub cpu_attention_ratio: f64,
    /// Blocks recalled.
    pub recalled_blocks: u64,
    /// Bytes recalled.
    pub recalled_bytes: u64,
    /// Recalled blocks selected at their layer's next step.
    pub recalled_blocks_used: u64,
    /// Share of the real selection the predicted query found.
    pub prediction_hit_ratio: f64,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Seconds the device side waited on this request's CPU attention.
    pub device_wait_seconds: f64,
    /// Seconds the device sat with nothing queued during the steps this request was in.
    pub device_idle_seconds: f64,
    /// Each layer's CPU share at every step, when the attention config profiles.
    pub layer_cpu_history: Vec<Vec<f32>>,
}

/// What a job's stream carries.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// One generated token.
    Token {
        /// 0-based index in the stream.
        index: u32,
        /// Token id.
        id: u32,
        /// Text it completes.
        text: String,
        /// Log-probability under the model.
        logprob: f32,
        /// The most likely tokens under the model, most likely first (as many as asked).
        top_logprobs: Vec<TopLogprob>,
    },
    /// The last event of a stream.
    Finish {
        /// Why.
        reason: FinishReason,
        /// Tokens generated.
        generated: u32,
        /// Figures.
        stats: RequestStats,
    },
    /// The request could not run (the last event).
    Error(EngineError),
}

/// One of the most likely tokens at a step.
#[derive(Debug, Clone, PartialEq)]
pub struct TopLogprob {
    /// Token id.
    pub id: u32,
    /// The token decoded alone.
    pub text: String,
    /// Log-probability under the model.
    pub logprob: f32,
}

/// What shapes a generation's output beyond sampling.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OutputOptions {
    /// EOS and stop ids are banned, and stop strings not matched, before this many tokens.
    pub min_tokens: u32,
    /// Stop strings: the text ends before the first one.
    pub stop_strings: Vec<String>,
    /// Most likely tokens reported per step.
    pub top_logprobs: u32,
}

/// A generation to run: its committed KV (taken from the registry) and what to do.
#[derive(Debug)]
pub struct Job {
    /// The KV.
    pub kv: Box<CommittedKv>,
    /// The rest.
    pub spec: JobSpec,
}

/// What to generate and where to send it.
#[derive(Debug)]
pub struct JobSpec {
    /// Request id.
    pub request_id: String,
    /// Sampling.
    pub sampling: Sampling,
    /// Tokens to generate at most (> 0).
    pub max_new_tokens: u32,
    /// Extra stop ids.
    pub stop_ids: Vec<u32>,
    /// Do not stop on EOS.
    pub ignore_eos: bool,
    /// min_tokens, stop strings, top logprobs.
    pub output: OutputOptions,
    /// When the Generate arrived.
    pub arrived: Instant,
    /// Where events go.
    pub events: mpsc::UnboundedSender<Event>,
    /// The request's span (id, mode, prompt tokens): the engine logs admission, errors and the
    /// finish inside it, so one request's lines from push to finish share their fields.
    pub span: tracing::Span,
}

/// Messages to the engine thread.
#[derive(Debug)]
pub enum Control {
    /// Queue a job.
    Submit(Job),
    /// Cancel a job by id (queued or running).
    Cancel(String, &'static str),
    /// Cancel everything and exit.
    Shutdown,
}
