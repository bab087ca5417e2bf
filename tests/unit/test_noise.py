"""dtf.program.noise: TensorFlow's chatter is dropped from the program's stderr, everything else passes."""

from __future__ import annotations

from dtf.program.noise import NoiseFilter

# As a stock tf-keras program under ParameterServerStrategy printed them (TensorFlow 2.21).
NOISY = b"""WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
I0000 00:00:1795433291.474749   18585 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used.
I0000 00:00:1795433291.552365   18585 cpu_feature_guard.cc:227] This TensorFlow binary is optimized to use available CPU instructions in performance-critical operations.
To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow with the appropriate compiler flags.
E0000 00:00:1795433295.624863   18585 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)
I0000 00:00:1795433295.646801   18585 grpc_server_lib.cc:467] Started server with target: grpc://127.0.0.1:50135
/x/site-packages/tensorflow/python/data/ops/dataset_ops.py:463: UserWarning: To make it possible to preserve tf.data options across serialization boundaries, their implementation has moved
  warnings.warn("To make it possible to preserve tf.data options across "
Epoch 1/2
I0000 00:00:1795433299.401701   18585 kernel_and_device.cc:101] Ignoring error status when releasing multi-device function handle UNIMPLEMENTED: Releasing a multi-device component handle on a remote device is not yet implemented.
10/10 - 3s - loss: 0.6012 - accuracy: 0.6531 - lr: 0.0100 - 3s/epoch - 339ms/step
WARNING:tensorflow:5 out of the last 5 calls to <function MultiDeviceSaver.save.<locals>.tf_function_save at 0x7f1dd873de40> triggered tf.function retracing. Tracing is expensive
W0000 00:00:1795433329.758108   21054 local_rendezvous.cc:412] Local rendezvous is aborting with status: NOT_FOUND: ./explicit/ckpt_temp; No such file or directory
\t [[{{node SaveV2}}]]
Additional GRPC error information from remote target /job:ps/replica:0/task:0 while calling /tensorflow.WorkerService/RecvTensor:
:UNKNOWN:Error received from peer  {grpc_status:5, grpc_message:"./explicit/ckpt_temp; No such file or directory\\n\\t [[{{node SaveV2}}]]"}
\t [[ShardedFilename/_4]]
2026-11-23 11:27:22.123456: I tensorflow/core/platform/cpu_feature_guard.cc:182] old format
ERROR:tensorflow:Remote function on worker /job:worker/replica:0/task:1 failed with CancelledError():CANCELLED
Additional GRPC error information from remote target /job:worker/replica:0/task:1 while calling /tensorflow.eager.EagerService/Enqueue:
:UNKNOWN:Error received from peer  {grpc_status:1, grpc_message:"CANCELLED"} [Op:__inference_train_function_1076]
This derived error is ignored and not reported to users.
"""
KEPT = b"""WARNING:tensorflow:Found source dataset of type <class '_TensorSliceDataset'>. This type is not efficiently shardable
ERROR:tensorflow: /job:worker/task:1 encountered the following error when processing closure: InvalidArgumentError()
E0000 00:00:1795433302.667130   19954 some_file.cc:59] a real error
Additional GRPC error information from remote target /job:worker/replica:0/task:1 while calling Enqueue:
Traceback (most recent call last):
  File "prog.py", line 44, in <module>
\t [[{{node MultiDeviceIteratorGetNextFromShard}}]]
tensorflow.python.framework.errors_impl.NotFoundError: ./ckpt_1_temp; No such file or directory
"""


def filtered(*chunks: bytes) -> bytes:
    out: list[bytes] = []
    noise = NoiseFilter(out.append)
    for chunk in chunks:
        noise.feed(chunk)
    noise.close()
    return b"".join(out)


def test_tensorflow_chatter_is_dropped_and_everything_else_kept() -> None:
    assert filtered(NOISY) == b"Epoch 1/2\n10/10 - 3s - loss: 0.6012 - accuracy: 0.6531 - lr: 0.0100 - 3s/epoch - 339ms/step\n"
    assert filtered(KEPT) == KEPT  # errors, their context and tracebacks, the program's warnings
    assert filtered(NOISY + KEPT) == filtered(NOISY) + KEPT


def test_lines_split_across_reads_are_judged_whole() -> None:
    data = NOISY + KEPT
    assert filtered(*(data[i:i + 7] for i in range(0, len(data), 7))) == filtered(data)
    assert filtered(b"I0000 00:00:1.2 ", b"  1 x.cc:1] chatter\nkept", b" at the end") == b"kept at the end"


def test_a_partial_line_that_cannot_be_noise_passes_at_once() -> None:
    out: list[bytes] = []
    noise = NoiseFilter(out.append)
    noise.feed(b"\r 40%|####      | 4/10")  # a progress bar on stderr: no newline until the end
    assert out == [b"\r 40%|####      | 4/10"]
    noise.feed(b"\r100%|##########| 10/10\n")
    assert b"".join(out) == b"\r 40%|####      | 4/10\r100%|##########| 10/10\n"


def test_whole_lines_are_judged_as_the_stream_is() -> None:
    """`keeps`, for output that comes in lines (collective mode's copies): the same verdicts, the
    continuation lines of a noise line included."""
    noise = NoiseFilter()
    text = (NOISY + KEPT).decode()
    kept = [line for line in text.splitlines() if noise.keeps(line)]
    assert "\n".join(kept) + "\n" == filtered(NOISY + KEPT).decode()
