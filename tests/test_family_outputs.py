"""Every tiny family's export is byte-identical to what it was when these digests were recorded (before the
family-module redesign, issue 30, at 053a1a5): a change meant to keep behaviour keeps these. A change meant
to alter an export updates the digest it changes, in the same commit, saying why. Exports are numpy-
deterministic (seeded weights, no BLAS in the write path), so the digests hold on any CPU -- provided no
constant comes from a numpy float32 transcendental, whose last bit differs between numpy's AVX2 and AVX-512
code (FLUX.2 dev's and Qwen-Image's text-encoder digests, recorded on an AVX-512 machine, failed on an AVX2 one
until the LLM RoPE frequencies were computed in float64 and rounded once: their digests now are those of the
correctly rounded constants); images are compared with `tests/family_outputs.py --png` before and after on one
machine instead."""
import pytest

from family_outputs import EXPORTS, export_digests

RECORDED = {
    # the LLM text encoders (flux2-klein, qwen-image, z-image) changed at stop 41: a query that sees no key (a
    # left-padded prompt's padding) gets a zero attention output, as torch's SDPA gives it (one Mul per layer);
    # Qwen-Image's VAE writes only each causal 3-D kernel's last time slice (Graph.param `take`), not the whole
    "flux2-dev": {       # recorded when added (issue 32), stop 41
        "scheduler": "efc2fc82b31dda5cc00a2264bf5d357290d0bb0aff144ad8f998467fc3210fec",
        "text_encoder": "81f7754649fcb119286cd0db1ce22c90ab3c3c82c968fb883b24178b00d94511",
        "tokenizer": "cd58f0f0d6d26abae07ba8d11e2f403b7ab8f089c270db4b2ae60c2f68c72881",
        "transformer": "61244f6a849960f74a6de0503408925a37042cc818e99882e5735350428edf43",
        "vae_decoder": "2e1ea1910ed6e7fb91ba6ce63000d32a693f475e0eb6c85ad5140181d3227f64",
        "vae_encoder": "43909e49b6de3894812badc84024a27e1f3b11558ac238302c62ec73643c3160",
    },
    "flux2-klein": {     # recorded when added (issue 32), at 2c7191e
        "scheduler": "efc2fc82b31dda5cc00a2264bf5d357290d0bb0aff144ad8f998467fc3210fec",
        "text_encoder": "160b7905e33f240e3fa9fd025afd29cdc4268ea307f501c187ebc57cf02775a5",
        "tokenizer": "07ac6ce07e248a57b35e9531ddcdf27c04d978af83fed70494500e7b3cf3add1",
        "transformer": "6b38bfdf0bcdc6be9adc64d529b40ad40fd30147beae469bb626d776c97af87d",
        "vae_decoder": "aefc286e595e71bd59de37123a52f0d2f8672b234b513a864a0682c295de5e71",
        "vae_encoder": "21cb044c1beb2387327eb97cb1b092ea645fb952ff6667768831f7c3a31bf964",
    },
    "qwen-image": {      # recorded when added (issue 32), at 2c7191e
        # stop 42: the diffusers scheduler config keeps the released schedule's shift_terminal 0.02 (was dropped)
        "scheduler": "4697c8e033c2dadb780d57884123376e1a46b8553437b620a5546b18ff5b6abd",
        "text_encoder": "43d5f0d1e2605bcb91ceaa12b805e36a359a9412efa50f55b01061619fb6099f",
        "tokenizer": "07ac6ce07e248a57b35e9531ddcdf27c04d978af83fed70494500e7b3cf3add1",
        "transformer": "543dee04145dbebb05a080567d4223ce9826575f36c6aad1497ac1f05b347834",
        "vae_decoder": "11462bb0423c4114883c7e2dcd0186a4615e9622a73bcb777da85100ad015e80",
        "vae_encoder": "7eabb1960fa03fb7151842fbb29dfa699f63b15356142b82b12f4813d5c2e840",
    },
    "chroma": {
        "scheduler": "efc2fc82b31dda5cc00a2264bf5d357290d0bb0aff144ad8f998467fc3210fec",
        "text_encoder": "2c102093a0b0afa47e4d69d36b0022569d85e18d6e84f1e84a0d2c4c955ff4b5",
        "tokenizer": "97f2695b4626c44b011c0914939cdd8c3324d3e89fc89b3b3f5ab687357752ca",
        "transformer": "f4559b88241c332eee0476c787962cda4f2bae18b6bd08e88aff98cde9c6fd62",
        "vae_decoder": "5c53cc2df6ef8b046c1afb2aaac10bd6259dafa9182a2810671dca63fa6813da",
        "vae_encoder": "6fcc5c8f20343dc0027141a2b2e500125843527f9c62a0c7b75611656b531adf",
    },
    "controlnet": {
        "controlnet_demo": "c3db88241f92985136540aca0d02ed94b22ef12dc5c89e44119bd05f3fc3bb5f",
        "scheduler": "3a0b4d89a80d9f59ddcd0f4a2c0678da93ee47557ca6c723b9d86b3c413999fd",
        "text_encoder": "ad34a77a9dd549b3d0c17fc29b09fa8247cf975dffb85267e348d88196f317cf",
        "tokenizer": "4b7968468fc5a20be39ec9e0e9cad2c84da1c8035e793cc636d2c03a19269ac9",
        "unet": "7ce8441d22aae2139aedc60c0185616d664b895608af095b77ef2d88a61ad4c9",
        "vae_decoder": "eb368be3886facc1e9ec2af9bff0143a382b184c841fbb252e52f3ee3e724428",
        "vae_encoder": "fe0fb0457d9edb2669843825633abe61fb17879ad563dfa0aa4ff5217c81528c",
    },
    "flux-dev": {
        "scheduler": "efc2fc82b31dda5cc00a2264bf5d357290d0bb0aff144ad8f998467fc3210fec",
        "text_encoder": "1300e8bdf59f5916ed827f01c8ddfcca22239550050db0adc381ff9e81da419a",
        "text_encoder_2": "3816525f8239d732702a37a35d996d552e488d1f5065e8ccf7156f49f6aba378",
        "tokenizer": "4b7968468fc5a20be39ec9e0e9cad2c84da1c8035e793cc636d2c03a19269ac9",
        "tokenizer_2": "97f2695b4626c44b011c0914939cdd8c3324d3e89fc89b3b3f5ab687357752ca",
        "transformer": "fa4e41832d156b6894047644f726bf502bc53084ff2804a2c5df04ae69dd3c95",
        "vae_decoder": "f774804380eac688b038c3dc2133e1218f4008b398e95b2863188b46ca251452",
        "vae_encoder": "35706bfc4b0fa2c67be5d64147ed078167419254559bda6a110108a9402e8111",
    },
    "flux-schnell": {
        "scheduler": "bc137c93987f085ec7a5cff2c3425c5d0e21dc4dd2de36835a1be4e316ff43a1",
        "text_encoder": "17ef6b458649309096e978f9ebe6648d9279d00cc122468606b2f3439058a21c",
        "text_encoder_2": "cc3022763301cf7284b36cca7b1a8a3df9529171e6b9650b930092de838daf60",
        "tokenizer": "4b7968468fc5a20be39ec9e0e9cad2c84da1c8035e793cc636d2c03a19269ac9",
        "tokenizer_2": "97f2695b4626c44b011c0914939cdd8c3324d3e89fc89b3b3f5ab687357752ca",
        "transformer": "539dc752eb8ca2ac23ae6a81f47ddfbd9d3ca032bcf43241951e422fa347c3aa",
        "vae_decoder": "e0a16da250618b47a5270de9551e8f615551e431c5bde5a10cf76f8e3c9d7424",
        "vae_encoder": "b249b62c19c0735e77acb6ab216e616dc66d9e58e19676a1529b50c6e592b3e1",
    },
    "inpaint": {
        "scheduler": "3a0b4d89a80d9f59ddcd0f4a2c0678da93ee47557ca6c723b9d86b3c413999fd",
        "text_encoder": "46463df71e486009ff670c40991f86a3d2432aa9fb70866873a4f03046d9fcba",
        "tokenizer": "4b7968468fc5a20be39ec9e0e9cad2c84da1c8035e793cc636d2c03a19269ac9",
        "unet": "60bfd097f015189fc52835cb40b2714c220868aa46694d8f5fd8c0b9b17946aa",
        "vae_decoder": "3c11d55bebee6e63bbe748238cc84ab8cc27514936f97d7fb4a34e5d1a4ffe02",
        "vae_encoder": "372180e506f87f4d6857fd70b462b66a2710fb8f6b3bedadbbb1b4c7495e072c",
    },
    "lora": {
        "scheduler": "3a0b4d89a80d9f59ddcd0f4a2c0678da93ee47557ca6c723b9d86b3c413999fd",
        "text_encoder": "b9181ad77e3d8ff73b8ad780f7f1ef15103d9ef343c461c4826eea7b852721a9",
        "tokenizer": "4b7968468fc5a20be39ec9e0e9cad2c84da1c8035e793cc636d2c03a19269ac9",
        "unet": "a3f8458cc574535db7c3d7c671c5525d66bc44ed4e2b7cb04b3db0044c194d65",
        "vae_decoder": "de0adf515e942f23f4786e21d37b169d0b0c0fd722a49ef2e18246a5202b6c7f",
        "vae_encoder": "40f63cb6ba0f5fdd9ccab18ee61f6516ab632c1fb31aab827547cb17f0485cce",
    },
    "sd15": {
        "scheduler": "3a0b4d89a80d9f59ddcd0f4a2c0678da93ee47557ca6c723b9d86b3c413999fd",
        "text_encoder": "ad34a77a9dd549b3d0c17fc29b09fa8247cf975dffb85267e348d88196f317cf",
        "tokenizer": "4b7968468fc5a20be39ec9e0e9cad2c84da1c8035e793cc636d2c03a19269ac9",
        "unet": "bf1fe134b201f63a599a0aeb79eff38d1e14748fcd215fad2bbfba4cf6c9f28a",
        "vae_decoder": "eb368be3886facc1e9ec2af9bff0143a382b184c841fbb252e52f3ee3e724428",
        "vae_encoder": "fe0fb0457d9edb2669843825633abe61fb17879ad563dfa0aa4ff5217c81528c",
    },
    "sd2": {
        "scheduler": "3a0b4d89a80d9f59ddcd0f4a2c0678da93ee47557ca6c723b9d86b3c413999fd",
        "text_encoder": "6637c801897efba51bb9a52fe2a20a02e7647896508a1408301df8a10cd70eec",
        "tokenizer": "c25535b9f80d0c6091806063fd295ec34006997e20dd2feb6b5a64e9d9bb36ef",
        "unet": "bd850fc92cd625afcd946229e8339e01047b83dd6839c4ecbfed623ca6b178e7",
        "vae_decoder": "644e40d1c5e7cc89da96110946ca9294e389cffafcbae643d53a406c17473548",
        "vae_encoder": "075aa75bb0e1465688ae4e5013fdb9c5f69bbee8934abbf95a15211a905d2741",
    },
    "sd3": {
        "scheduler": "dd96639f9c0edc340801545fbdb48fc9e5874032b23dad3c3182f0d989a72684",
        "text_encoder": "5440b4f83174fad062ca20a4b65ca95dadd196494367f32d343cf26bf658a903",
        "text_encoder_2": "626be599a9c37bb6911d8a67ec9136eb2b2f03cdaa17320174fb14ea0edab229",
        "text_encoder_3": "eb0bc8a0ddd56da7a0a885c41ca682f00118ee579f60e145d35877a89c4400f4",
        "tokenizer": "4b7968468fc5a20be39ec9e0e9cad2c84da1c8035e793cc636d2c03a19269ac9",
        "tokenizer_2": "c25535b9f80d0c6091806063fd295ec34006997e20dd2feb6b5a64e9d9bb36ef",
        "tokenizer_3": "97f2695b4626c44b011c0914939cdd8c3324d3e89fc89b3b3f5ab687357752ca",
        "transformer": "bc8eca142a2ba8f59d3eef9adde90c7ac167c468b9490a589347a9b6b336f5e9",
        "vae_decoder": "adf242944f9f9c02372dfca85522f54b68770806bb0090d7f14eaa7e9f4d98b4",
        "vae_encoder": "24abfeef86879ff79da252c8a076ced31762f7aa69489e1a23428c73f617f201",
    },
    "sd35-large": {
        "scheduler": "dd96639f9c0edc340801545fbdb48fc9e5874032b23dad3c3182f0d989a72684",
        "text_encoder": "2eb428ed999fdecacb3acdcf8e83f78a36ee69db9f46be97535b18c7bba0f99f",
        "text_encoder_2": "74dbc587d10f403493e4dfe701f1b25cb3e217df3c4a1568838966daeaaf5108",
        "text_encoder_3": "ab5a7c4e029ccdba2c08d7c01f79fba1025f4f28343dc4568ce9339e311cb3bb",
        "tokenizer": "4b7968468fc5a20be39ec9e0e9cad2c84da1c8035e793cc636d2c03a19269ac9",
        "tokenizer_2": "c25535b9f80d0c6091806063fd295ec34006997e20dd2feb6b5a64e9d9bb36ef",
        "tokenizer_3": "97f2695b4626c44b011c0914939cdd8c3324d3e89fc89b3b3f5ab687357752ca",
        "transformer": "63142d5b5f4e7b1d745c8ded00884346a73ca543139a31db9f51935f110a1c98",
        "vae_decoder": "e55f602758a3688f6ff465ad83f5de5dbbad5465b2c4b02212adbedc53f1d891",
        "vae_encoder": "9969cc56d6cf20f03adc697ea0fcf02e78d8122a0345501e041d8c4486ceee89",
    },
    "sd35-medium": {
        "scheduler": "dd96639f9c0edc340801545fbdb48fc9e5874032b23dad3c3182f0d989a72684",
        "text_encoder": "46fcc5f169b9afb04e07bfce0da3b0c961825d26392f0760b09623377b54278c",
        "text_encoder_2": "def32270aa0b4aa6ef0ba8994ce497e54c57984fabc085cc9c526421321e2c87",
        "text_encoder_3": "652f2bc4fc8412f48a27fe68836905b43dd8aa0c7b409f444c5d965d7d2a2853",
        "tokenizer": "4b7968468fc5a20be39ec9e0e9cad2c84da1c8035e793cc636d2c03a19269ac9",
        "tokenizer_2": "c25535b9f80d0c6091806063fd295ec34006997e20dd2feb6b5a64e9d9bb36ef",
        "tokenizer_3": "97f2695b4626c44b011c0914939cdd8c3324d3e89fc89b3b3f5ab687357752ca",
        "transformer": "b3ff4e78485e02b3750b23ee6c1cad6ae30e5399b8b06ac54f7181cf48cce499",
        "vae_decoder": "275c36ded9051fec54123e572d3f7e9d932f512c17ea268a6b3479a44c041014",
        "vae_encoder": "6b86630a9e159e8db26c43a3369d0d7ee83b19112d8860b25091069601e6d12a",
    },
    "sdxl": {
        "scheduler": "3a0b4d89a80d9f59ddcd0f4a2c0678da93ee47557ca6c723b9d86b3c413999fd",
        "text_encoder": "efab373f2602ba90b520dbe973509b6fdd88a0658aa9c318ad2dbb8a3ef647bc",
        "text_encoder_2": "4ddb9b2c7f29734dc99528ec9bc8c68f24b26e5ca3bffc628eb37f66bd181e2e",
        "tokenizer": "4b7968468fc5a20be39ec9e0e9cad2c84da1c8035e793cc636d2c03a19269ac9",
        "tokenizer_2": "c25535b9f80d0c6091806063fd295ec34006997e20dd2feb6b5a64e9d9bb36ef",
        "unet": "70726cb951d669de0e0c1e4b4a5abcb88204b47c0de998d081fe2b61bd24b24c",
        "vae_decoder": "aa01edb9679fb99993a182bef71e18d14f5fe4385f08350df9ed0cfca574e169",
        "vae_encoder": "1b43f077015bc19272b97c4b75fb37a4f9b34affeb61c1c1c91a9b37de5e6ed0",
    },
    "z-image": {
        "scheduler": "dd96639f9c0edc340801545fbdb48fc9e5874032b23dad3c3182f0d989a72684",
        "text_encoder": "8c90e0d62a38a38c8dde1127b1774d9b77ab87ef208237bed8f8e46eb2b7e3e5",
        "tokenizer": "07ac6ce07e248a57b35e9531ddcdf27c04d978af83fed70494500e7b3cf3add1",
        "transformer": "bda39dfb205cd65a513fe0657a0dcfc394741902d0d4223a8aa64393979372ff",   # stop 44: text positions clamped to the table
        "vae_decoder": "01d5aa745d8556dfb2fb03623d71d4d509a224e414208c7dcb2b732649f4d43d",
        "vae_encoder": "dd8b89494214014d30c57cb2b4c24c2679fc15376e2cea1656f95e6a629c496f",
    },
}


@pytest.mark.parametrize("family", sorted(EXPORTS))
def test_export_is_as_recorded(family, tmp_path):
    assert export_digests(family, tmp_path) == RECORDED[family]
