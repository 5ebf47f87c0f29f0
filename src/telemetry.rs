//! Trace context across the hops of a delegation, and (with the `otel`
//! cargo feature) OpenTelemetry export.
//!
//! Every hop (`delegate`, the worker's `task`, the wake's `turn`) has a
//! tracing span and publishes a W3C `traceparent` for the next hop. [`hop`]
//! ties the two together: the span becomes a child of the `traceparent` the
//! hop received, and the `traceparent` it returns (the one to publish) names
//! that span. Without an OpenTelemetry layer installed, the returned value is
//! a fresh child of the one received, as before: the trace id still flows
//! and shows in every log line, only no spans are exported.

use crate::protocol::TraceParent;

/// Makes `span` the hop that follows `parent` (a new trace when `None`) and
/// returns the `traceparent` to publish for the next hop.
///
/// With the `otel` feature and an OpenTelemetry layer in the subscriber, the
/// exported span is a child of `parent` and the returned value carries that
/// span's own id, so a collector links the next hop's span to it. Otherwise
/// (or when the span is disabled) the result is `parent.child()`.
pub fn hop(span: &tracing::Span, parent: Option<TraceParent>) -> TraceParent {
    #[cfg(feature = "otel")]
    if let Some(own) = otlp::hop(span, parent) {
        return own;
    }
    #[cfg(not(feature = "otel"))]
    let _ = span;
    parent.map_or_else(TraceParent::new_root, |parent| parent.child())
}

#[cfg(feature = "otel")]
pub mod otlp {
    //! OTLP/HTTP (protobuf) export of wakebus's spans.
    //!
    //! Configured by the standard variables (`OTEL_EXPORTER_OTLP_ENDPOINT`,
    //! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `OTEL_EXPORTER_OTLP_HEADERS`,
    //! `OTEL_EXPORTER_OTLP_TIMEOUT`, `OTEL_SERVICE_NAME`,
    //! `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_BSP_*`, `OTEL_SDK_DISABLED`) or an
    //! explicit endpoint. Nothing is exported unless an endpoint is given one
    //! way or the other.

    use opentelemetry::trace::{
        SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState, TracerProvider as _,
    };
    use opentelemetry_otlp::WithExportConfig;
    use opentelemetry_sdk::Resource;
    use opentelemetry_sdk::trace::SdkTracerProvider;
    use tracing::Subscriber;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    use tracing_subscriber::Layer;
    use tracing_subscriber::filter::filter_fn;
    use tracing_subscriber::registry::LookupSpan;

    use crate::protocol::TraceParent;

    /// The spans exported: one per hop of a delegation.
    pub const HOP_SPANS: [&str; 3] = ["delegate", "task", "turn"];

    /// The service name when `OTEL_SERVICE_NAME` is not set.
    pub const DEFAULT_SERVICE_NAME: &str = "wakebus";

    /// Why the exporter could not be set up.
    #[derive(Debug, thiserror::Error)]
    pub enum OtlpError {
        /// The OTLP exporter rejected its configuration.
        #[error("cannot build the OTLP exporter: {0}")]
        Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
    }

    /// Where and how to export.
    #[derive(Debug, Clone, Default)]
    pub struct OtlpConfig {
        /// Base URL of the collector's OTLP/HTTP receiver (as
        /// `OTEL_EXPORTER_OTLP_ENDPOINT`: `/v1/traces` is appended). `None`:
        /// the standard variables decide, and without them nothing is
        /// exported.
        pub endpoint: Option<String>,
    }

    impl OtlpConfig {
        /// The traces URL to export to, if export is on: the explicit
        /// endpoint, else `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (as is), else
        /// `OTEL_EXPORTER_OTLP_ENDPOINT` (+ `/v1/traces`); off when
        /// `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`.
        fn traces_url(&self) -> Option<String> {
            let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
            if var("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true"))
                || var("OTEL_TRACES_EXPORTER").is_some_and(|v| v.eq_ignore_ascii_case("none"))
            {
                return None;
            }
            let base = |url: &str| format!("{}/v1/traces", url.trim_end_matches('/'));
            self.endpoint
                .as_deref()
                .map(base)
                .or_else(|| var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
                .or_else(|| var("OTEL_EXPORTER_OTLP_ENDPOINT").map(|url| base(&url)))
        }
    }

    /// Keeps the exporter running; [`OtlpGuard::shutdown`] (or drop)
    /// flushes the spans not yet sent.
    #[derive(Debug)]
    pub struct OtlpGuard {
        /// The provider whose batch processor holds unsent spans.
        provider: Option<SdkTracerProvider>,
    }

    impl OtlpGuard {
        /// Sends what is buffered and stops the exporter (blocking: call it
        /// outside the async runtime, once the command has returned).
        pub fn shutdown(mut self) {
            self.flush();
        }

        fn flush(&mut self) {
            if let Some(provider) = self.provider.take()
                && let Err(error) = provider.shutdown()
            {
                eprintln!("warning: could not flush the OpenTelemetry spans: {error}");
            }
        }
    }

    impl Drop for OtlpGuard {
        fn drop(&mut self) {
            self.flush();
        }
    }

    /// The tracing layer that exports wakebus's spans over OTLP/HTTP, and
    /// its guard; `Ok(None)` when no endpoint is configured.
    ///
    /// Exported: the hop spans ([`HOP_SPANS`]) and the `wakebus` events at
    /// INFO or above logged inside them, whatever the log filter. Not the
    /// long-lived spans around them (a wake's per-session actor), nor other
    /// crates' spans: the HTTP client's would feed the exporter its own work.
    pub fn layer<S>(
        config: &OtlpConfig,
    ) -> Result<Option<(impl Layer<S> + use<S>, OtlpGuard)>, OtlpError>
    where
        S: Subscriber + for<'span> LookupSpan<'span>,
    {
        let Some(url) = config.traces_url() else {
            return Ok(None);
        };
        crate::http_client::install_crypto_provider();
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
            .with_endpoint(url)
            .build()?;
        let mut resource = Resource::builder();
        if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
            resource = resource.with_service_name(DEFAULT_SERVICE_NAME);
        }
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(resource.build())
            .build();
        let tracer = provider.tracer("wakebus");
        let layer = tracing_opentelemetry::layer()
            .with_tracer(tracer)
            .with_filter(filter_fn(|meta| {
                (meta.target() == "wakebus" || meta.target().starts_with("wakebus::"))
                    && *meta.level() <= tracing::Level::INFO
                    && (meta.is_event() || HOP_SPANS.contains(&meta.name()))
            }));
        Ok(Some((
            layer,
            OtlpGuard {
                provider: Some(provider),
            },
        )))
    }

    /// [`super::hop`] with an OpenTelemetry layer: `None` when the span is
    /// not exported (no layer, disabled span), so the caller falls back.
    pub(super) fn hop(span: &tracing::Span, parent: Option<TraceParent>) -> Option<TraceParent> {
        if let Some(parent) = parent {
            let remote = SpanContext::new(
                TraceId::from(parent.trace_id),
                SpanId::from(parent.span_id),
                TraceFlags::new(parent.flags),
                true,
                TraceState::default(),
            );
            span.set_parent(opentelemetry::Context::new().with_remote_span_context(remote))
                .ok()?;
        }
        let context = span.context();
        let own = context.span().span_context().clone();
        if !own.is_valid() {
            return None;
        }
        Some(TraceParent {
            trace_id: u128::from_be_bytes(own.trace_id().to_bytes()),
            span_id: u64::from_be_bytes(own.span_id().to_bytes()),
            flags: own.trace_flags().to_u8(),
        })
    }
}
