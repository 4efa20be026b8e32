//! The one error type of this crate and its gRPC mapping.

use tonic::{Code, Status};

/// Longest client-supplied string echoed in an error message (bytes).
pub const MAX_ECHO: usize = 128;

/// `s` cut to at most [`MAX_ECHO`] bytes on a character boundary, marked when cut: a client
/// cannot make our errors, logs or metrics as large as what it sent.
pub fn clip(s: &str) -> std::borrow::Cow<'_, str> {
    if s.len() <= MAX_ECHO {
        return s.into();
    }
    let mut end = MAX_ECHO - 3;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end]).into()
}

/// What can go wrong in the pool, an ingest or a claim.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum Error {
    /// The pool could not be built as configured.
    #[error("configuration: {0}")]
    Config(String),
    /// The host KV pool cannot hold the request.
    #[error("host KV pool exhausted: need {needed} bytes, {free} free")]
    Exhausted {
        /// Bytes the request needs.
        needed: u64,
        /// Bytes not yet promised.
        free: u64,
    },
    /// A malformed message: bad shape, range, CRC, order, duplicate chunk.
    #[error("{0}")]
    Invalid(String),
    /// The push does not match this node's model or KV layout; names the field.
    #[error(
        "{field} mismatch: node has {}, push has {}",
        clip(expected),
        clip(got)
    )]
    Mismatch {
        /// The header field that differs.
        field: &'static str,
        /// This node's value.
        expected: String,
        /// The pushed value.
        got: String,
    },
    /// The request id already holds KV (or is being pushed) on this node.
    #[error("request {:?} already exists on this node", clip(.0))]
    AlreadyExists(String),
    /// No KV for this request id.
    #[error("no KV for request {:?}", clip(.0))]
    NotFound(String),
    /// Waiting for a request's KV took longer than allowed.
    #[error("KV for request {:?} did not arrive in time", clip(.0))]
    Timeout(String),
    /// The push or the request was cancelled (Cancel, client gone).
    #[error("request {:?} was cancelled", clip(.0))]
    Cancelled(String),
    /// `DropKv` ended the request's push while it was in flight.
    #[error("request {:?} was dropped (DropKv) while its KV was being pushed", clip(.0))]
    Dropped(String),
    /// Another stream of a push that arrives on several streams failed, which ends the
    /// whole push (its message says why).
    #[error("another stream of this push failed, so the push is dropped: {0}")]
    StreamFailed(String),
    /// The push sent nothing for longer than the idle timeout, or outlived its deadline.
    #[error("{0}")]
    PushTimeout(String),
    /// The request's lease was required and missing, or given and wrong.
    #[error("request {:?}: its push's lease is missing or wrong", clip(.0))]
    Lease(String),
    /// The node is draining and admits no new work.
    #[error("node is draining")]
    Draining,
}

impl Error {
    /// The gRPC code a client can act on; also the `code` label of error metrics.
    pub fn code(&self) -> Code {
        match self {
            Error::Config(_) => Code::Internal,
            Error::Exhausted { .. } => Code::ResourceExhausted,
            Error::Invalid(_) => Code::InvalidArgument,
            Error::Mismatch { .. } => Code::FailedPrecondition,
            Error::AlreadyExists(_) => Code::AlreadyExists,
            Error::NotFound(_) => Code::NotFound,
            Error::Timeout(_) => Code::DeadlineExceeded,
            Error::Cancelled(_) => Code::Cancelled,
            Error::Dropped(_) | Error::StreamFailed(_) => Code::Aborted,
            Error::PushTimeout(_) => Code::DeadlineExceeded,
            Error::Lease(_) => Code::PermissionDenied,
            Error::Draining => Code::Unavailable,
        }
    }

    /// Lower-case label of [`Error::code`] for metrics (`invalid_argument`, …).
    pub fn code_label(&self) -> &'static str {
        code_label(self.code())
    }
}

/// Lower-case snake name of a gRPC code, for metric labels.
pub fn code_label(code: Code) -> &'static str {
    match code {
        Code::Ok => "ok",
        Code::Cancelled => "cancelled",
        Code::Unknown => "unknown",
        Code::InvalidArgument => "invalid_argument",
        Code::DeadlineExceeded => "deadline_exceeded",
        Code::NotFound => "not_found",
        Code::AlreadyExists => "already_exists",
        Code::PermissionDenied => "permission_denied",
        Code::ResourceExhausted => "resource_exhausted",
        Code::FailedPrecondition => "failed_precondition",
        Code::Aborted => "aborted",
        Code::OutOfRange => "out_of_range",
        Code::Unimplemented => "unimplemented",
        Code::Internal => "internal",
        Code::Unavailable => "unavailable",
        Code::DataLoss => "data_loss",
        Code::Unauthenticated => "unauthenticated",
    }
}

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        Status::new(e.code(), e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn echoed_strings_are_clipped_on_a_char_boundary() {
        assert_eq!(clip("short"), "short");
        let long = "é".repeat(200);
        let c = clip(&long);
        assert!(c.len() <= MAX_ECHO && c.ends_with("..."), "{}", c.len());
        let e = Error::NotFound("x".repeat(10_000));
        assert!(e.to_string().len() < MAX_ECHO + 32, "{e}");
        let m = Error::Mismatch {
            field: "model_id",
            expected: "m".into(),
            got: "g".repeat(1 << 20),
        };
        assert!(Status::from(m).message().len() < 2 * MAX_ECHO + 64);
    }
}
