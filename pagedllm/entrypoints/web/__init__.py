"""The browser pages (chat at / and /ui, the live engine view at /ui/engine) and the
engine-state route they poll; the static files ship with the package (no build step, no CDN)."""
