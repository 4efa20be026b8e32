//! The decode node: model executor, batch engine, gRPC service, metrics and CLI.
#![warn(missing_debug_implementations, rust_2018_idioms)]
#![deny(unsafe_op_in_unsafe_fn)]

pub mod cli;
