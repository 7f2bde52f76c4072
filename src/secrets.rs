//! Secret references in configuration values, resolved once when the configuration loads.
//!
//! A value of `[source.kafka]`, `[sink.kafka]` or `api.admin_token` may be, as a whole:
//! - `${file:/path}`: the file's content, less one trailing newline (as `kubectl create secret
//!   --from-file` and most editors leave one). This is how Kubernetes mounts a Secret.
//! - `${env:NAME}`: the environment variable `NAME`, for a Secret mapped to a variable of any name.
//! - `$${...}`: the literal text `${...}`, for a value that really starts with `${`.
//!
//! Anything else is taken as written. A reference that cannot be resolved is a configuration error
//! naming the key and the file or variable, never a value: a secret stays out of the process list
//! (no command-line flag takes one) and out of every message.

use std::collections::HashMap;
use std::io::Read;
use std::path::Path;

use crate::config::{Config, ConfigError, Secret};

/// Bigger than any key, password or CA bundle: a reference to a device or a log file by mistake
/// must fail rather than read without end.
const MAX_FILE_BYTES: u64 = 1 << 20;

/// Resolves every reference in the keys that may hold secrets, in place, and returns one error per
/// reference that could not be resolved (its key keeps the reference text).
pub(crate) fn resolve(config: &mut Config, env: &HashMap<String, String>) -> Vec<ConfigError> {
    let mut errors = Vec::new();
    for (section, props) in [
        ("source", &mut config.source.kafka),
        ("sink", &mut config.sink.kafka),
    ] {
        for (name, value) in props.values_mut() {
            resolve_one(&format!("{section}.kafka.{name}"), value, env, &mut errors);
        }
    }
    if let Some(token) = &mut config.api.admin_token {
        let mut value = token.expose().to_string();
        resolve_one("api.admin_token", &mut value, env, &mut errors);
        *token = Secret::new(value);
    }
    errors
}

fn resolve_one(
    key: &str,
    value: &mut String,
    env: &HashMap<String, String>,
    errors: &mut Vec<ConfigError>,
) {
    match lookup(value, env) {
        Ok(Some(resolved)) => *value = resolved,
        Ok(None) => {}
        Err(message) => errors.push(ConfigError::new(key, message)),
    }
}

/// The value a reference stands for; `None` when `value` is no reference. Messages name the file
/// or variable but never quote the value, which may be a secret that merely looks like a
/// reference.
fn lookup(value: &str, env: &HashMap<String, String>) -> Result<Option<String>, String> {
    if let Some(escaped) = value.strip_prefix("$${") {
        return Ok(Some(format!("${{{escaped}")));
    }
    let Some(inner) = value.strip_prefix("${").and_then(|v| v.strip_suffix('}')) else {
        return Ok(None);
    };
    if let Some(path) = inner.strip_prefix("file:") {
        return read_file(Path::new(path)).map(Some);
    }
    if let Some(name) = inner.strip_prefix("env:") {
        return match env.get(name) {
            Some(v) => Ok(Some(v.clone())),
            None => Err(format!(
                "${{env:{name}}}: the environment variable {name} is not set (or not UTF-8): set it, \
                 e.g. from a Kubernetes secretKeyRef, or correct the name"
            )),
        };
    }
    Err(
        "the value has the form ${...} but is neither ${file:/path} nor ${env:NAME}: use one of \
         those, or write $${ for a value that starts with a literal ${"
            .to_string(),
    )
}

fn read_file(path: &Path) -> Result<String, String> {
    let shown = path.display();
    if !path.is_absolute() {
        return Err(format!(
            "${{file:{shown}}}: the path is relative; write it absolute, e.g. \
             ${{file:/var/run/secrets/eos-bridge/password}}"
        ));
    }
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes))
        .map_err(|e| {
            format!("${{file:{shown}}}: cannot read the file ({e}): mount the secret there or correct the path")
        })?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(format!(
            "${{file:{shown}}}: the file is larger than {MAX_FILE_BYTES} bytes, too large for a secret: \
             check the path"
        ));
    }
    let mut text = String::from_utf8(bytes)
        .map_err(|_| format!("${{file:{shown}}}: the file is not UTF-8 text"))?;
    if text.ends_with('\n') {
        text.pop();
        if text.ends_with('\r') {
            text.pop();
        }
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn references_resolve_and_everything_else_is_literal() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("pw");
        std::fs::write(&file, "from-file-1b2c\n").unwrap();
        let vars = env(&[("PW", "from-env-3d4e")]);
        let reference = format!("${{file:{}}}", file.display());
        assert_eq!(lookup(&reference, &vars), Ok(Some("from-file-1b2c".into())));
        assert_eq!(lookup("${env:PW}", &vars), Ok(Some("from-env-3d4e".into())));
        assert_eq!(lookup("$${env:PW}", &vars), Ok(Some("${env:PW}".into())));
        for literal in ["plain", "", "$", "${env:PW", "x${env:PW}", "$env:PW}"] {
            assert_eq!(lookup(literal, &vars), Ok(None), "{literal}");
        }
    }

    #[test]
    fn only_one_trailing_newline_is_trimmed() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("pw");
        for (content, expected) in [
            ("pw\n", "pw"),
            ("pw\r\n", "pw"),
            ("pw\n\n", "pw\n"),
            (" pw ", " pw "),
            ("", ""),
        ] {
            std::fs::write(&file, content).unwrap();
            assert_eq!(read_file(&file), Ok(expected.to_string()), "{content:?}");
        }
    }

    #[test]
    fn failures_name_the_file_or_variable_and_never_the_value() {
        let dir = tempfile::tempdir().unwrap();
        let vars = env(&[]);
        let missing = dir.path().join("absent");
        let message = lookup(&format!("${{file:{}}}", missing.display()), &vars).unwrap_err();
        assert!(
            message.contains(&missing.display().to_string()),
            "{message}"
        );
        assert!(message.contains("mount the secret"), "{message}");

        let message = lookup("${env:NOT_SET_7f7f}", &vars).unwrap_err();
        assert!(message.contains("NOT_SET_7f7f is not set"), "{message}");

        let message = lookup("${file:relative/pw}", &vars).unwrap_err();
        assert!(message.contains("relative"), "{message}");

        let binary = dir.path().join("binary");
        std::fs::write(&binary, [0xff, 0xfe]).unwrap();
        let message = lookup(&format!("${{file:{}}}", binary.display()), &vars).unwrap_err();
        assert!(message.contains("not UTF-8"), "{message}");

        let big = dir.path().join("big");
        std::fs::write(&big, vec![b'a'; MAX_FILE_BYTES as usize + 1]).unwrap();
        let message = lookup(&format!("${{file:{}}}", big.display()), &vars).unwrap_err();
        assert!(message.contains("too large"), "{message}");

        // A password that merely looks like a reference must not be echoed.
        let message = lookup("${hunter2-9a9a}", &vars).unwrap_err();
        assert!(!message.contains("hunter2-9a9a"), "{message}");
        assert!(message.contains("$${"), "{message}");
    }
}
