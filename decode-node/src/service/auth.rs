//! Bearer-token authentication of every RPC but health.

use tonic::service::Interceptor;
use tonic::{Request, Status};

/// Checks `authorization: Bearer <token>` when a token is configured.
#[derive(Clone, Default)]
pub struct BearerCheck {
    token: Option<std::sync::Arc<str>>,
}

impl std::fmt::Debug for BearerCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the token.
        f.debug_struct("BearerCheck")
            .field("enabled", &self.token.is_some())
            .finish()
    }
}

impl BearerCheck {
    /// Checks against `token`, or admits everything when `None`.
    pub fn new(token: Option<String>) -> Self {
        Self {
            token: token.map(|t| t.into()),
        }
    }
}

/// Compares without an early exit, so timing does not reveal a prefix of the token.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl Interceptor for BearerCheck {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        let Some(want) = &self.token else {
            return Ok(req);
        };
        let got = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .ok_or_else(|| Status::unauthenticated("missing bearer token"))?;
        if same(got.as_bytes(), want.as_bytes()) {
            Ok(req)
        } else {
            Err(Status::unauthenticated("invalid bearer token"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_the_token() {
        let mut c = BearerCheck::new(Some("s3cret".into()));
        let mut ok = Request::new(());
        ok.metadata_mut()
            .insert("authorization", "Bearer s3cret".parse().unwrap());
        assert!(c.call(ok).is_ok());
        let mut bad = Request::new(());
        bad.metadata_mut()
            .insert("authorization", "Bearer s3cres".parse().unwrap());
        assert_eq!(
            c.call(bad).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
        assert_eq!(
            c.call(Request::new(())).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
        assert!(BearerCheck::new(None).call(Request::new(())).is_ok());
    }
}
