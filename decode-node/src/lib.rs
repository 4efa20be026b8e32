//! The decode node: model executor, batch engine, gRPC service, metrics and CLI.
//!
//! - [`model`]: HF loader, embedded `tiny` model, Llama-family forward pass, sampling.
//! - [`backend`]: the [`backend::Backend`] trait of dense ops and its CPU implementation.
#![warn(missing_debug_implementations, rust_2018_idioms)]
#![deny(unsafe_op_in_unsafe_fn)]

pub mod backend;
pub mod bench;
pub mod cli;
pub mod client;
pub mod commands;
pub mod engine;
pub mod metrics;
pub mod model;
pub mod node;
pub mod service;
pub mod tensor;
