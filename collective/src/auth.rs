//! Who may join a job: the per-job secret (`ARBOR_JOB_TOKEN`) and the challenge–response
//! that proves knowledge of it on every TCP connection without sending it.
//!
//! The exchange, connector C (rank > 0, or rank j opening the mesh link to rank i) and
//! acceptor S:
//! 1. C → S `AuthHello`: a fresh 32-byte nonce `nc` and whether C holds a token.
//! 2. S → C `AuthChallenge`: a fresh nonce `ns`, whether S holds a token, and
//!    `HMAC(token, "arbor acceptor" | purpose | nc | ns)`.
//! 3. C checks S's proof (a port taken over by someone else is not this job's rank), then
//!    C → S `AuthProof`: `HMAC(token, "arbor connector" | purpose | ns | nc)`.
//! 4. S checks it and answers `AuthOk`, or an `Abort` naming the reason.
//!
//! Both nonces enter both proofs, so a proof recorded from one connection is worthless on
//! the next; the role label keeps one side's proof from being reflected back as the other's.
//! The comparison is hmac's constant-time `verify_slice`. What this does not give: secrecy
//! or integrity of the traffic after the handshake (no encryption); an attacker on the path
//! between two ranks can still read or alter it.

use std::io::Read;
use std::path::Path;

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::CommError;

/// The job's secret itself (arbor-launch sets it for its ranks).
pub const TOKEN_VAR: &str = "ARBOR_JOB_TOKEN";
/// A file holding the secret (mpirun, Slurm, or by hand: a file the ranks share).
pub const TOKEN_FILE_VAR: &str = "ARBOR_JOB_TOKEN_FILE";
/// `1`: listen on every interface instead of only MASTER_ADDR's.
pub const BIND_ALL_VAR: &str = "ARBOR_BIND_ALL";

/// Length of each side's nonce.
pub const NONCE_LEN: usize = 32;
/// A token file larger than this is not a token (and is not read whole).
const MAX_TOKEN_FILE: u64 = 64 << 10;

type HmacSha256 = Hmac<Sha256>;

/// The job's shared secret. Its bytes never appear in `Debug` output or messages.
#[derive(Clone, PartialEq, Eq)]
pub struct JobToken(Vec<u8>);

impl std::fmt::Debug for JobToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "JobToken(<{} bytes>)", self.0.len())
    }
}

impl JobToken {
    /// A token from its text; surrounding whitespace (a file's newline) is not part of it.
    pub fn new(text: &str, origin: &str) -> Result<JobToken, CommError> {
        let t = text.trim();
        if t.is_empty() {
            return Err(CommError::Config(format!(
                "{origin} is empty: a job token needs at least one non-blank character"
            )));
        }
        Ok(JobToken(t.as_bytes().to_vec()))
    }

    /// Reads the token from the file at `path` (ARBOR_JOB_TOKEN_FILE).
    pub fn from_file(path: &Path) -> Result<JobToken, CommError> {
        let what = format!("{TOKEN_FILE_VAR}={}", path.display());
        let f = std::fs::File::open(path)
            .map_err(|e| CommError::Config(format!("{what}: cannot open the token file: {e}")))?;
        let mut text = String::new();
        f.take(MAX_TOKEN_FILE + 1)
            .read_to_string(&mut text)
            .map_err(|e| CommError::Config(format!("{what}: cannot read the token file: {e}")))?;
        if text.len() as u64 > MAX_TOKEN_FILE {
            return Err(CommError::Config(format!(
                "{what}: the token file is larger than {MAX_TOKEN_FILE} bytes; is it the right file?"
            )));
        }
        JobToken::new(
            &text,
            &format!("the token file {} ({TOKEN_FILE_VAR})", path.display()),
        )
    }

    fn mac(&self) -> HmacSha256 {
        // HMAC takes keys of any length; new_from_slice cannot fail for it.
        match HmacSha256::new_from_slice(&self.0) {
            Ok(m) => m,
            Err(_) => unreachable!("HMAC accepts keys of every length"),
        }
    }
}

/// How this process guards its listeners: the job token (None: unauthenticated) and whether
/// to listen on every interface.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Security {
    pub token: Option<JobToken>,
    pub bind_all: bool,
}

impl Security {
    /// Reads ARBOR_JOB_TOKEN, ARBOR_JOB_TOKEN_FILE and ARBOR_BIND_ALL.
    pub fn from_env() -> Result<Security, CommError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Like [`Security::from_env`] over any variable lookup (tests pass a map).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Security, CommError> {
        let token = match (get(TOKEN_VAR), get(TOKEN_FILE_VAR)) {
            (Some(_), Some(_)) => {
                return Err(CommError::Config(format!(
                    "both {TOKEN_VAR} and {TOKEN_FILE_VAR} are set; set only one"
                )))
            }
            (Some(t), None) => Some(JobToken::new(&t, TOKEN_VAR)?),
            (None, Some(p)) if p.trim().is_empty() => {
                return Err(CommError::Config(format!(
                    "{TOKEN_FILE_VAR} is set but empty; give the path of the token file"
                )))
            }
            (None, Some(p)) => Some(JobToken::from_file(Path::new(p.trim()))?),
            (None, None) => None,
        };
        let bind_all = match get(BIND_ALL_VAR).as_deref().map(str::trim) {
            None | Some("") | Some("0") => false,
            Some("1") => true,
            Some(v) => {
                return Err(CommError::Config(format!(
                    "{BIND_ALL_VAR}={v:?}: give 1 (listen on every interface) or 0"
                )))
            }
        };
        Ok(Security { token, bind_all })
    }
}

/// Which connection a proof is for; bound into the MAC so that a proof made for one kind
/// of link is not accepted on the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    Rendezvous,
    Mesh,
}

impl Purpose {
    fn label(self) -> &'static [u8] {
        match self {
            Purpose::Rendezvous => b"rendezvous",
            Purpose::Mesh => b"mesh",
        }
    }
}

/// Step 1, connector → acceptor.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct AuthHello {
    pub nonce: [u8; NONCE_LEN],
    pub has_token: bool,
}

/// Step 2, acceptor → connector.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct AuthChallenge {
    pub nonce: [u8; NONCE_LEN],
    pub has_token: bool,
    /// Empty when the acceptor has no token.
    pub proof: Vec<u8>,
}

/// Step 3, connector → acceptor.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct AuthProof {
    pub proof: Vec<u8>,
}

/// A fresh nonce from the OS's random source.
pub fn nonce() -> Result<[u8; NONCE_LEN], CommError> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n)
        .map_err(|e| CommError::Other(format!("the OS random source failed: {e}")))?;
    Ok(n)
}

const ACCEPTOR: &[u8] = b"arbor acceptor v1";
const CONNECTOR: &[u8] = b"arbor connector v1";

fn mac_of(
    token: &JobToken,
    role: &[u8],
    purpose: Purpose,
    first: &[u8],
    second: &[u8],
) -> HmacSha256 {
    let mut m = token.mac();
    // Length-prefix every part: no two different tuples feed the MAC the same bytes.
    for part in [role, purpose.label(), first, second] {
        m.update(&(part.len() as u32).to_le_bytes());
        m.update(part);
    }
    m
}

/// The acceptor's proof over (connector nonce, acceptor nonce).
pub fn acceptor_proof(token: &JobToken, purpose: Purpose, nc: &[u8], ns: &[u8]) -> Vec<u8> {
    mac_of(token, ACCEPTOR, purpose, nc, ns)
        .finalize()
        .into_bytes()
        .to_vec()
}

/// The connector's proof over (acceptor nonce, connector nonce).
pub fn connector_proof(token: &JobToken, purpose: Purpose, ns: &[u8], nc: &[u8]) -> Vec<u8> {
    mac_of(token, CONNECTOR, purpose, ns, nc)
        .finalize()
        .into_bytes()
        .to_vec()
}

/// Checks an acceptor's proof in constant time.
pub fn verify_acceptor(
    token: &JobToken,
    purpose: Purpose,
    nc: &[u8],
    ns: &[u8],
    proof: &[u8],
) -> bool {
    mac_of(token, ACCEPTOR, purpose, nc, ns)
        .verify_slice(proof)
        .is_ok()
}

/// Checks a connector's proof in constant time.
pub fn verify_connector(
    token: &JobToken,
    purpose: Purpose,
    ns: &[u8],
    nc: &[u8],
    proof: &[u8],
) -> bool {
    mac_of(token, CONNECTOR, purpose, ns, nc)
        .verify_slice(proof)
        .is_ok()
}

/// Why the acceptor turns a connector away, as the connector is told. Never includes a
/// token's bytes.
pub fn mismatch_reason(acceptor_has: bool, connector_has: bool) -> Option<String> {
    match (acceptor_has, connector_has) {
        (true, false) => Some(format!(
            "this job requires a job token and the connecting process has none \
             (set {TOKEN_VAR} or {TOKEN_FILE_VAR} as for the other ranks)"
        )),
        (false, true) => Some(format!(
            "the connecting process has a job token but this job runs without one \
             (unset {TOKEN_VAR}/{TOKEN_FILE_VAR}, or give the same token to every rank)"
        )),
        _ => None,
    }
}

/// The text of a refusal for a wrong proof.
pub fn wrong_token_reason() -> String {
    format!("job token mismatch ({TOKEN_VAR} / {TOKEN_FILE_VAR} differ from this job's)")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn tok(s: &str) -> JobToken {
        JobToken::new(s, "test").unwrap()
    }

    #[test]
    fn proofs_bind_token_nonces_role_and_purpose() {
        let (a, b) = (tok("secret-a"), tok("secret-b"));
        let nc = [1u8; NONCE_LEN];
        let ns = [2u8; NONCE_LEN];
        let p = connector_proof(&a, Purpose::Rendezvous, &ns, &nc);
        assert!(verify_connector(&a, Purpose::Rendezvous, &ns, &nc, &p));
        assert!(!verify_connector(&b, Purpose::Rendezvous, &ns, &nc, &p));
        // Replayed on a connection with another acceptor nonce.
        assert!(!verify_connector(
            &a,
            Purpose::Rendezvous,
            &[3u8; NONCE_LEN],
            &nc,
            &p
        ));
        assert!(!verify_connector(&a, Purpose::Mesh, &ns, &nc, &p));
        // The acceptor's proof over the same nonces is not a connector proof.
        let s = acceptor_proof(&a, Purpose::Rendezvous, &nc, &ns);
        assert!(verify_acceptor(&a, Purpose::Rendezvous, &nc, &ns, &s));
        assert!(!verify_connector(&a, Purpose::Rendezvous, &nc, &ns, &s));
        assert!(!verify_connector(
            &a,
            Purpose::Rendezvous,
            &ns,
            &nc,
            &p[..31]
        ));
    }

    #[test]
    fn token_sources() {
        let map = |v: &[(&str, &str)]| -> HashMap<String, String> {
            v.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let sec = |v: &[(&str, &str)]| {
            let m = map(v);
            Security::from_lookup(|k| m.get(k).cloned())
        };
        assert_eq!(sec(&[]).unwrap(), Security::default());
        assert_eq!(
            sec(&[(TOKEN_VAR, " abc\n")]).unwrap().token,
            Some(tok("abc"))
        );
        assert!(sec(&[(BIND_ALL_VAR, "1")]).unwrap().bind_all);
        let e = sec(&[(BIND_ALL_VAR, "yes")]).unwrap_err().to_string();
        assert!(e.contains("ARBOR_BIND_ALL=\"yes\""), "{e}");
        let e = sec(&[(TOKEN_VAR, "  ")]).unwrap_err().to_string();
        assert!(e.contains("ARBOR_JOB_TOKEN is empty"), "{e}");

        let dir = std::env::temp_dir().join(format!("arbor-auth-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("token");
        std::fs::write(&file, "from-a-file\n").unwrap();
        let path = file.to_str().unwrap();
        assert_eq!(
            sec(&[(TOKEN_FILE_VAR, path)]).unwrap().token,
            Some(tok("from-a-file"))
        );
        std::fs::write(&file, "\n \n").unwrap();
        let e = sec(&[(TOKEN_FILE_VAR, path)]).unwrap_err().to_string();
        assert!(e.contains(path) && e.contains("is empty"), "{e}");
        let missing = dir.join("nope");
        let e = sec(&[(TOKEN_FILE_VAR, missing.to_str().unwrap())])
            .unwrap_err()
            .to_string();
        assert!(e.contains("nope") && e.contains("cannot open"), "{e}");
        let e = sec(&[(TOKEN_FILE_VAR, path), (TOKEN_VAR, "x")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("set only one"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(format!("{:?}", tok("hunter2")), "JobToken(<7 bytes>)");
    }
}
