//! Hostfiles in OpenMPI's format: one host per line, `host [slots=N] [max_slots=M]`,
//! `#` starts a comment, blank lines are ignored. A host listed twice adds its slots.

use std::path::{Path, PathBuf};

/// One host and how many ranks it takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Host {
    pub name: String,
    pub slots: usize,
    /// Line of its first mention (for messages).
    pub line: usize,
}

/// A parsed hostfile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hostfile {
    pub path: PathBuf,
    pub hosts: Vec<Host>,
}

#[derive(Debug, thiserror::Error)]
pub enum HostfileError {
    #[error("cannot read hostfile {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("hostfile {}, line {line}: {msg}: {text:?}", path.display())]
    Malformed {
        path: PathBuf,
        line: usize,
        text: String,
        msg: String,
    },
    #[error("hostfile {} lists no hosts", path.display())]
    Empty { path: PathBuf },
}

impl Hostfile {
    pub fn load(path: &Path) -> Result<Hostfile, HostfileError> {
        let text = std::fs::read_to_string(path).map_err(|e| HostfileError::Read {
            path: path.to_path_buf(),
            source: e,
        })?;
        Self::parse(path, &text)
    }

    pub fn parse(path: &Path, text: &str) -> Result<Hostfile, HostfileError> {
        let mut hosts: Vec<Host> = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            let content = raw.split('#').next().unwrap_or("").trim();
            if content.is_empty() {
                continue;
            }
            let bad = |msg: String| HostfileError::Malformed {
                path: path.to_path_buf(),
                line,
                text: raw.to_string(),
                msg,
            };
            let mut words = content.split_whitespace();
            let name = words.next().unwrap_or_default();
            if name.contains('=') {
                return Err(bad(format!("expected a host name first, got {name:?}")));
            }
            let mut slots: Option<usize> = None;
            for w in words {
                let (key, value) = w.split_once('=').ok_or_else(|| {
                    bad(format!("expected key=value after the host name, got {w:?}"))
                })?;
                let n: usize = value
                    .parse()
                    .map_err(|_| bad(format!("{key}={value:?} is not a non-negative integer")))?;
                match key {
                    "slots" => {
                        if n == 0 {
                            return Err(bad("slots=0: a host needs at least one slot".into()));
                        }
                        slots = Some(n);
                    }
                    // OpenMPI's upper bound for oversubscription; arbor-launch has its own flag.
                    "max_slots" | "max-slots" => {}
                    _ => {
                        return Err(bad(format!(
                            "unknown attribute {key:?} (known: slots, max_slots)"
                        )))
                    }
                }
            }
            // OpenMPI's default without slots= is one slot (for a hostfile entry).
            let slots = slots.unwrap_or(1);
            match hosts.iter_mut().find(|h| h.name == name) {
                Some(h) => h.slots += slots,
                None => hosts.push(Host {
                    name: name.to_string(),
                    slots,
                    line,
                }),
            }
        }
        if hosts.is_empty() {
            return Err(HostfileError::Empty {
                path: path.to_path_buf(),
            });
        }
        Ok(Hostfile {
            path: path.to_path_buf(),
            hosts,
        })
    }

    pub fn total_slots(&self) -> usize {
        self.hosts.iter().map(|h| h.slots).sum()
    }
}

/// Whether `name` is this machine.
pub fn is_local(name: &str) -> bool {
    let name = name.trim_start_matches('[').trim_end_matches(']');
    if matches!(
        name,
        "localhost" | "localhost.localdomain" | "127.0.0.1" | "::1"
    ) {
        return true;
    }
    match host_name() {
        Some(me) => {
            let short = |s: &str| s.split('.').next().unwrap_or(s).to_string();
            name == me || short(name) == short(&me)
        }
        None => false,
    }
}

fn host_name() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates on success
    // when the name fits, and we stop at the first NUL or the end anyway.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8(buf[..end].to_vec()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Hostfile, HostfileError> {
        Hostfile::parse(Path::new("hf"), text)
    }

    #[test]
    fn openmpi_format() {
        let h =
            parse("# comment\n\nnode1 slots=4 max_slots=8\nnode2   # one slot\nnode1 slots=2\n")
                .unwrap();
        assert_eq!(
            h.hosts,
            vec![
                Host {
                    name: "node1".into(),
                    slots: 6,
                    line: 3
                },
                Host {
                    name: "node2".into(),
                    slots: 1,
                    line: 4
                },
            ]
        );
        assert_eq!(h.total_slots(), 7);
    }

    #[test]
    fn malformed_lines_name_the_line() {
        for (text, line, what) in [
            (
                "localhost slots=8\nlocalhost slots=abc\n",
                2,
                "not a non-negative integer",
            ),
            ("a slots=1\n\n# x\nb slots\n", 4, "key=value"),
            ("slots=4\n", 1, "host name first"),
            ("a cpus=2\n", 1, "unknown attribute"),
            ("a slots=0\n", 1, "slots=0"),
        ] {
            let e = parse(text).unwrap_err();
            let msg = e.to_string();
            assert!(
                matches!(e, HostfileError::Malformed { line: l, .. } if l == line),
                "{msg}"
            );
            assert!(
                msg.contains(&format!("line {line}")) && msg.contains(what),
                "{msg}"
            );
            assert!(msg.contains("hostfile hf"), "{msg}");
        }
        assert!(matches!(
            parse("# nothing\n"),
            Err(HostfileError::Empty { .. })
        ));
    }

    #[test]
    fn repository_hostfiles_parse() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../hostfiles");
        let local = Hostfile::load(&dir.join("localhost")).unwrap();
        assert_eq!(local.total_slots(), 8);
        assert!(local.hosts.iter().all(|h| is_local(&h.name)));
        let multi = Hostfile::load(&dir.join("multi-node.example")).unwrap();
        assert_eq!(multi.hosts.len(), 2);
        assert_eq!(multi.total_slots(), 16);
    }

    #[test]
    fn local_names() {
        assert!(is_local("localhost"));
        assert!(is_local("127.0.0.1"));
        assert!(!is_local("surely-not-this-host.invalid"));
        if let Some(me) = host_name() {
            assert!(is_local(&me));
        }
    }
}
