//! Bearer-token authentication of every RPC but health, with a role per token.

use std::sync::Arc;

use tonic::service::Interceptor;
use tonic::{Request, Status};

/// What a token may call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// `KvTransfer` (PushKv, DropKv): the prefill side.
    Push,
    /// `Decode` (Generate, Cancel, GetLoad, WatchLoad, GetModelInfo): the orchestrator.
    Generate,
    /// Everything, reflection included.
    Admin,
}

impl Role {
    fn parse(s: &str) -> Option<Self> {
        match s {
            "push" => Some(Role::Push),
            "generate" => Some(Role::Generate),
            "admin" => Some(Role::Admin),
            _ => None,
        }
    }
}

/// The tokens of an auth file and the roles of each.
#[derive(Clone, Default)]
pub struct Tokens(Arc<Vec<(String, Vec<Role>)>>);

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print a token.
        f.debug_struct("Tokens")
            .field("count", &self.0.len())
            .finish()
    }
}

/// A malformed auth file line.
#[derive(Debug, thiserror::Error)]
#[error("auth token file line {line}: {why}")]
pub struct TokensError {
    line: usize,
    why: String,
}

impl Tokens {
    /// Parses an auth file: `TOKEN` (every role) or `TOKEN ROLE[,ROLE]` per line; blank lines
    /// and `#` comments are skipped.
    pub fn parse(text: &str) -> Result<Self, TokensError> {
        let mut out = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let err = |why: String| TokensError { line: i + 1, why };
            let line = raw.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let mut parts = line.split_whitespace();
            let token = parts.next().unwrap_or_default().to_string();
            let roles = match parts.next() {
                None => vec![Role::Admin],
                Some(list) => list
                    .split(',')
                    .map(|r| {
                        Role::parse(r).ok_or_else(|| {
                            err(format!("unknown role {r:?} (push, generate or admin)"))
                        })
                    })
                    .collect::<Result<_, _>>()?,
            };
            if parts.next().is_some() {
                return Err(err("expected `TOKEN` or `TOKEN ROLE[,ROLE]`".into()));
            }
            out.push((token, roles));
        }
        if out.is_empty() {
            return Err(TokensError {
                line: 0,
                why: "no token".into(),
            });
        }
        Ok(Self(Arc::new(out)))
    }
}

/// Checks `authorization: Bearer <token>` for a role when tokens are configured.
#[derive(Clone, Default, Debug)]
pub struct BearerCheck {
    tokens: Option<Tokens>,
    role: Option<Role>,
}

impl BearerCheck {
    /// Checks against `tokens`, or admits everything when `None`.
    pub fn new(tokens: Option<Tokens>) -> Self {
        Self { tokens, role: None }
    }

    /// The same tokens, admitting only those with `role` (or admin).
    pub fn for_role(&self, role: Role) -> Self {
        Self {
            tokens: self.tokens.clone(),
            role: Some(role),
        }
    }
}

/// Compares in constant time (`subtle`, whose barriers keep the optimiser from adding an
/// early exit a hand-written fold could get), so timing does not reveal a prefix of the token.
fn same(a: &[u8], b: &[u8]) -> bool {
    use subtle::ConstantTimeEq;
    bool::from(a.ct_eq(b))
}

impl Interceptor for BearerCheck {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        let Some(tokens) = &self.tokens else {
            return Ok(req);
        };
        let got = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .ok_or_else(|| Status::unauthenticated("missing bearer token"))?;
        // Every token is compared, so the time taken does not tell which one matched.
        let roles = tokens
            .0
            .iter()
            .filter(|(t, _)| same(got.as_bytes(), t.as_bytes()))
            .fold(None, |_, (_, r)| Some(r));
        let Some(roles) = roles else {
            return Err(Status::unauthenticated("invalid bearer token"));
        };
        match self.role {
            Some(want) if !roles.iter().any(|r| *r == want || *r == Role::Admin) => Err(
                Status::permission_denied(format!("this token's roles do not include {want:?}")),
            ),
            _ => Ok(req),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(token: &str) -> Request<()> {
        let mut r = Request::new(());
        r.metadata_mut()
            .insert("authorization", format!("Bearer {token}").parse().unwrap());
        r
    }

    #[test]
    fn checks_the_token() {
        let mut c = BearerCheck::new(Some(Tokens::parse("s3cret\n").unwrap()));
        assert!(c.call(with("s3cret")).is_ok());
        assert_eq!(
            c.call(with("s3cres")).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
        assert_eq!(
            c.call(Request::new(())).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
        assert!(BearerCheck::new(None).call(Request::new(())).is_ok());
    }

    #[test]
    fn roles_limit_what_a_token_may_call() {
        let t = Tokens::parse(
            "# node tokens\np1 push\ng1 generate  # orchestrator\na1 admin\nboth push,generate\n",
        )
        .unwrap();
        let all = BearerCheck::new(Some(t));
        let (mut push, mut generate) = (all.for_role(Role::Push), all.for_role(Role::Generate));
        let denied = tonic::Code::PermissionDenied;
        assert!(push.call(with("p1")).is_ok());
        assert_eq!(push.call(with("g1")).unwrap_err().code(), denied);
        assert!(generate.call(with("g1")).is_ok());
        assert_eq!(generate.call(with("p1")).unwrap_err().code(), denied);
        for t in ["a1", "both"] {
            assert!(push.call(with(t)).is_ok() && generate.call(with(t)).is_ok());
        }
        assert!(Tokens::parse("x reader\n").is_err());
        assert!(Tokens::parse("x push extra\n").is_err());
        assert!(Tokens::parse("# nothing\n\n").is_err());
    }
}
