//! The host names the dashboard answers to.
//!
//! A page on `attacker.example` can make the operator's browser talk to the dashboard under
//! the attacker's own name: its DNS answer first points at the attacker, then at 127.0.0.1
//! (DNS rebinding). The browser then treats the dashboard as `attacker.example`, same-origin
//! with the attacker's page, and sends `Host: attacker.example:8090`. So every request must
//! name this dashboard in `Host`, and a POST's `Origin` must name it too: the bound address,
//! the loopback names, or a name the operator allowed (`--allow-host`).

use axum::http::{HeaderMap, header};
use std::net::SocketAddr;

/// The names a request may carry in `Host` and `Origin` (lowercase, without a port).
#[derive(Debug, Clone)]
pub struct AllowedHosts {
    names: Vec<String>,
}

impl AllowedHosts {
    /// The loopback names, the address bound (unless it is the unspecified address) and
    /// `extra` (each a bare host name or IP address: no scheme, port or path).
    pub fn new(bound: SocketAddr, extra: &[String]) -> Result<Self, String> {
        let mut names: Vec<String> = ["localhost", "127.0.0.1", "[::1]"].map(String::from).to_vec();
        if !bound.ip().is_unspecified() {
            names.push(match bound {
                SocketAddr::V4(a) => a.ip().to_string(),
                SocketAddr::V6(a) => format!("[{}]", a.ip()),
            });
        }
        for e in extra.iter().map(|e| e.trim()).filter(|e| !e.is_empty()) {
            let name = normalize(e);
            let bracketed_v6 = name.starts_with('[') && name.ends_with(']');
            let plain = name.chars().all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-');
            if !(plain || bracketed_v6) || name.is_empty() {
                return Err(format!(
                    "--allow-host {e:?}: give a bare host name or address (dash.example.com, 10.0.0.5, \
                     [fd00::5]), without scheme, port or path"
                ));
            }
            names.push(name);
        }
        Ok(Self { names })
    }

    fn allows(&self, host: &str) -> bool {
        let host = normalize(host);
        self.names.contains(&host)
    }

    /// The allowed names, for error messages.
    fn listed(&self) -> String {
        self.names.join(", ")
    }

    /// `Ok` when the request's `Host` names this dashboard.
    pub fn check_host(&self, headers: &HeaderMap) -> Result<(), String> {
        let Some(raw) = headers.get(header::HOST) else {
            return Err("a request without a Host header".into());
        };
        let Ok(value) = raw.to_str() else { return Err("a Host header that is not text".into()) };
        let host = host_part(value);
        if self.allows(host) {
            Ok(())
        } else {
            Err(format!(
                "Host {:?} is not this dashboard (it answers to {}; add a name with --allow-host)",
                chime_shared::redact::escape_control(value),
                self.listed()
            ))
        }
    }

    /// `Ok` when `origin` (`scheme://host[:port]`) names this dashboard.
    pub fn check_origin(&self, origin: &str) -> Result<(), String> {
        let authority = origin
            .strip_prefix("http://")
            .or_else(|| origin.strip_prefix("https://"))
            .filter(|a| !a.contains(['/', '@', '?', '#']));
        match authority {
            Some(a) if self.allows(host_part(a)) => Ok(()),
            _ => Err(format!(
                "origin {:?} is not this dashboard",
                chime_shared::redact::escape_control(origin)
            )),
        }
    }
}

/// `host` of `host:port`, `[v6]` of `[v6]:port`.
fn host_part(authority: &str) -> &str {
    if authority.starts_with('[') {
        return authority.find(']').map_or(authority, |end| &authority[..=end]);
    }
    authority.split(':').next().unwrap_or(authority)
}

/// Lowercase, without the trailing dot of a fully qualified name.
fn normalize(host: &str) -> String {
    host.trim_end_matches('.').to_ascii_lowercase()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn host(h: &AllowedHosts, value: &'static str) -> bool {
        let mut headers = HeaderMap::new();
        headers.insert(header::HOST, HeaderValue::from_static(value));
        h.check_host(&headers).is_ok()
    }

    #[test]
    fn only_this_dashboards_names_are_answered() {
        let h = AllowedHosts::new("127.0.0.1:8090".parse().unwrap(), &["Dash.Example.com".into()]).unwrap();
        for ok in [
            "127.0.0.1:8090",
            "localhost:8090",
            "LOCALHOST",
            "[::1]:8090",
            "dash.example.com",
            "dash.example.com.:443",
        ] {
            assert!(host(&h, ok), "{ok}");
        }
        for bad in
            ["attacker.example:8090", "127.0.0.1.attacker.example", "localhost.attacker", "", "[::2]:8090"]
        {
            assert!(!host(&h, bad), "{bad}");
        }
        assert!(h.check_host(&HeaderMap::new()).is_err(), "no Host at all");
        assert!(h.check_origin("http://localhost:8090").is_ok());
        assert!(h.check_origin("https://dash.example.com").is_ok());
        assert!(h.check_origin("http://attacker.example:8090").is_err());
        assert!(h.check_origin("http://localhost@attacker.example").is_err());
        assert!(h.check_origin("ftp://localhost").is_err());
    }

    #[test]
    fn the_bound_address_counts_unless_unspecified() {
        let h = AllowedHosts::new("10.0.0.5:8090".parse().unwrap(), &[]).unwrap();
        assert!(host(&h, "10.0.0.5:8090"));
        let h = AllowedHosts::new("0.0.0.0:8090".parse().unwrap(), &[]).unwrap();
        assert!(!host(&h, "0.0.0.0:8090"));
        let h = AllowedHosts::new("[fd00::5]:8090".parse().unwrap(), &[]).unwrap();
        assert!(host(&h, "[fd00::5]:8090"));
    }

    #[test]
    fn allowed_names_are_bare_names() {
        for bad in ["http://dash.example", "dash.example:8090", "dash.example/x", "a b"] {
            let e = AllowedHosts::new("127.0.0.1:1".parse().unwrap(), &[bad.into()]).unwrap_err();
            assert!(e.contains(bad), "{e}");
        }
    }
}
