//! Chat templates: the checkpoint's Jinja template rendered with minijinja.
