//! CORS for browser front-ends (`--allowed-origins`): which origins may call
//! the API from a page, answered by tower-http's layer before routing, so a
//! preflight `OPTIONS` never meets the API-key check.

use axum::http::header::{AUTHORIZATION, CONTENT_TYPE};
use axum::http::{HeaderValue, Method};
use std::time::Duration;
use tower_http::cors::{AllowOrigin, CorsLayer};

/// Origins allowed to call the API from a browser.
#[derive(Clone, Debug, PartialEq)]
pub enum AllowedOrigins {
    /// `*`: any page (the API key, if set, still guards `/v1/*`).
    Any,
    /// Exact `scheme://host[:port]` origins.
    List(Vec<HeaderValue>),
}

#[derive(Debug, thiserror::Error, PartialEq)]
#[error("`{0}` is not an origin: give `*` or scheme://host[:port], e.g. https://chat.example.com")]
pub struct InvalidOrigin(pub String);

impl AllowedOrigins {
    /// `None` when `origins` is empty (no CORS headers at all).
    pub fn parse(origins: &[String]) -> Result<Option<Self>, InvalidOrigin> {
        if origins.is_empty() {
            return Ok(None);
        }
        if origins.iter().any(|o| o == "*") {
            return Ok(Some(AllowedOrigins::Any));
        }
        origins
            .iter()
            .map(|o| {
                let rest = o
                    .strip_prefix("http://")
                    .or_else(|| o.strip_prefix("https://"));
                match rest {
                    Some(host) if !host.is_empty() && !host.contains('/') => {
                        HeaderValue::from_str(o).map_err(|_| InvalidOrigin(o.clone()))
                    }
                    _ => Err(InvalidOrigin(o.clone())),
                }
            })
            .collect::<Result<_, _>>()
            .map(|l| Some(AllowedOrigins::List(l)))
    }

    pub(crate) fn layer(&self) -> CorsLayer {
        let origin = match self {
            AllowedOrigins::Any => AllowOrigin::any(),
            AllowedOrigins::List(l) => AllowOrigin::list(l.clone()),
        };
        CorsLayer::new()
            .allow_origin(origin)
            .allow_methods([Method::GET, Method::POST, Method::OPTIONS])
            .allow_headers([AUTHORIZATION, CONTENT_TYPE])
            .max_age(Duration::from_secs(600))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_parse_or_name_the_bad_one() {
        assert_eq!(AllowedOrigins::parse(&[]), Ok(None));
        let any = ["https://a.b".to_string(), "*".to_string()];
        assert_eq!(AllowedOrigins::parse(&any), Ok(Some(AllowedOrigins::Any)));
        let two = [
            "https://a.b".to_string(),
            "http://localhost:3000".to_string(),
        ];
        assert!(matches!(
            AllowedOrigins::parse(&two),
            Ok(Some(AllowedOrigins::List(l))) if l.len() == 2
        ));
        for bad in [
            "a.b",
            "https://",
            "https://a.b/path",
            "ftp://a.b",
            "https://a\nb",
        ] {
            assert_eq!(
                AllowedOrigins::parse(&[bad.to_string()]),
                Err(InvalidOrigin(bad.to_string()))
            );
        }
    }
}
